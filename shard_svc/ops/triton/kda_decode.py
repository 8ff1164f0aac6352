"""KDA decode step: one token per sequence, recurrent state updated in place in the pool by slot.

Reference: `shard_svc/ops/kda/eager.py::kda_decode` (and the token loop in `ops/kda/naive.py`).
One program owns one (sequence, head, V-block): it reads the [K, BV] fp32 state tile once, applies
    S = diag(exp(g)) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q
and writes the tile back. Gate, beta sigmoid and the q/k L2 norm are fused, so the step is one launch and the
state is the only large traffic (read + written once): the kernel is bandwidth-bound for N >= ~16 sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, check_index, pdl_args, pow2_at_least
from shard_svc.ops.triton.jit_helpers import pdl_prologue
from shard_svc.ops.triton.kda_gate import kda_gate_log2, l2_rnorm


@triton.jit
def _kda_decode_kernel(
    q, k, v, f, beta_logits, a_log, dt_bias, state, slots, o,
    stride_q, stride_k, stride_v, stride_f, stride_b,  # token strides (head stride is K, V or 1)
    stride_s_slot, stride_s_h, stride_s_k,  # state pool strides (V stride is 1)
    scale, lower_bound,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    i_b64 = i_b.to(tl.int64)
    slot = tl.load(slots + i_b).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V

    # Issue the state load first: it is the long-latency transfer, everything else is small.
    p_s = state + slot * stride_s_slot + i_h * stride_s_h + o_k[:, None] * stride_s_k + o_v[None, :]
    # No mask that varies along V unless V is padded: it would stop 16-byte vector loads of the state.
    if K == BK and V % BV == 0:
        m_s = o_k[:, None] < BK
    else:
        m_s = m_k[:, None] & m_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] fp32

    b_q = tl.load(q + i_b64 * stride_q + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_b64 * stride_k + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_f = tl.load(f + i_b64 * stride_f + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_b64 * stride_v + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.sigmoid(tl.load(beta_logits + i_b64 * stride_b + i_h).to(tl.float32))
    b_dt = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0)
    b_a = tl.exp(tl.load(a_log + i_h).to(tl.float32))

    b_g = kda_gate_log2(b_f, b_dt, b_a, lower_bound, USE_LOWER_BOUND)
    b_q = b_q * (l2_rnorm(b_q, 0) * scale)
    b_k = b_k * l2_rnorm(b_k, 0)

    b_s = b_s * tl.exp2(b_g)[:, None]
    b_u = b_beta * (b_v - tl.sum(b_s * b_k[:, None], 0))  # [BV]
    b_s = b_s + b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_s * b_q[:, None], 0)

    tl.store(p_s, b_s, mask=m_s)
    tl.store(o + i_b64 * H * V + i_h * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def _block_v(n_seq: int, heads: int, v_pad: int) -> int:
    """Small V-blocks when few sequences (more programs to hide latency), larger when many (less q/k rework)."""
    if n_seq * heads >= 2048:
        return min(v_pad, 64)
    if n_seq * heads >= 256:
        return min(v_pad, 32)
    return min(v_pad, 16)


def kda_decode(q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots, cu_seqlens,
               block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """Same contract as `ops.kda.eager.kda_decode`: one token per sequence (T == B); returns o [B, H, V]."""
    op = "kda_decode"
    n, heads, dk = q.shape
    dv = v.shape[-1]
    for name, x, shape in (("q", q, (n, heads, dk)), ("k", k, (n, heads, dk)), ("v", v, (n, heads, dv)),
                           ("f", f, (n, heads, dk))):
        check(op, name, x, dims=3)
        if tuple(x.shape) != shape or x.stride(1) != x.shape[2]:
            raise TritonKernelError(f"{op}: {name} {tuple(x.shape)} strides {x.stride()} must be {shape} with "
                                    "contiguous heads")
    check(op, "beta_logits", beta_logits, dims=2)
    check(op, "state_pool", state_pool, dtypes=(torch.float32,), dims=4)
    check(op, "a_log", a_log, dtypes=(torch.float32,), dims=1)
    check(op, "dt_bias", dt_bias, dtypes=(torch.float32,), dims=1)
    check_index(op, "slots", slots, n)
    if tuple(state_pool.shape[1:]) != (heads, dk, dv) or a_log.shape[0] < heads or dt_bias.shape[0] != heads * dk:
        raise TritonKernelError(f"{op}: state_pool {tuple(state_pool.shape)}, a_log {tuple(a_log.shape)}, dt_bias "
                                f"{tuple(dt_bias.shape)} do not match H={heads} K={dk} V={dv}")
    if tuple(beta_logits.shape) != (n, heads) or beta_logits.stride(1) != 1:
        raise TritonKernelError(f"{op}: beta_logits {tuple(beta_logits.shape)} must be [{n}, {heads}]")
    o = torch.empty(n, heads, dv, dtype=v.dtype, device=v.device)
    if n == 0:
        return o
    bk, vp = pow2_at_least(dk), pow2_at_least(dv)
    bv = block_v or _block_v(n, heads, vp)
    grid = (triton.cdiv(dv, bv), n * heads)
    _kda_decode_kernel[grid](
        q, k, v, f, beta_logits, a_log, dt_bias, state_pool, slots, o,
        q.stride(0), k.stride(0), v.stride(0), f.stride(0), beta_logits.stride(0),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        dk**-0.5, float(lower_bound) if lower_bound is not None else 0.0,
        H=heads, K=dk, V=dv, BK=bk, BV=bv, USE_LOWER_BOUND=lower_bound is not None,
        num_warps=num_warps or (4 if bk * bv >= 4096 else 2), **pdl_args(q.device),
    )
    return o
