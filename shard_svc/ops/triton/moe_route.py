"""Sigmoid top-k router: two launches instead of the eager path's dozen small ones.

Reference: `shard_svc/ops/moe/eager.py::moe_route`. `_router_logits_kernel` computes x W_gate^T with fp32
accumulation (products of bf16 inputs are exact in fp32, as in the eager path's upcast GEMM; only the summation
order differs), tiled over tokens and experts so a single decode token still spreads over many programs.
`_router_topk_kernel` then takes, per token, the sigmoid, chooses the top k by score + correction bias (one
arg-max per choice, ties to the lower expert id as torch.topk), gathers the unbiased scores of the chosen experts,
renormalises (+1e-20) and scales. No host sync: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, interpreting, pow2_at_least


@triton.jit
def _router_logits_kernel(x, w, logits, T, D, E, stride_x, stride_w, stride_l,
                          BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
                          PRECISION: tl.constexpr):
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    o_e = tl.program_id(1) * BE + tl.arange(0, BE)
    m_t = o_t < T
    m_e = o_e < E
    o_k = tl.arange(0, BK)
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for k0 in range(0, D, BK):
        m_k = (k0 + o_k) < D
        a = tl.load(x + o_t[:, None] * stride_x + (k0 + o_k)[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b = tl.load(w + o_e[None, :].to(tl.int64) * stride_w + (k0 + o_k)[:, None],
                    mask=m_k[:, None] & m_e[None, :], other=0.0)  # [BK, BE]
        if DOT_FP32:  # the interpreter multiplies bf16 dot operands wrongly
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(logits + o_t[:, None] * stride_l + o_e[None, :], acc, mask=m_t[:, None] & m_e[None, :])


@triton.jit
def _router_topk_kernel(logits, bias, weights, ids, T, E, stride_l, scaling,
                        K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr,
                        RENORMALIZE: tl.constexpr):
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_e = tl.arange(0, E_PAD)
    m_e = o_e < E
    score = tl.sigmoid(tl.load(logits + o_t[:, None] * stride_l + o_e[None, :], mask=m_t[:, None] & m_e[None, :],
                               other=0.0))
    b = tl.load(bias + o_e, mask=m_e, other=0.0).to(tl.float32)
    ranked = tl.where(m_e[None, :], score + b[None, :], float("-inf"))
    o_j = tl.arange(0, K_PAD)
    chosen_w = tl.zeros([BT, K_PAD], dtype=tl.float32)
    chosen_e = tl.zeros([BT, K_PAD], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.argmax(ranked, 1)  # [BT]
        hit = o_e[None, :] == best[:, None]
        w_j = tl.sum(tl.where(hit, score, 0.0), 1)
        chosen_w = tl.where(o_j[None, :] == j, w_j[:, None], chosen_w)
        chosen_e = tl.where(o_j[None, :] == j, best[:, None], chosen_e)
        ranked = tl.where(hit, float("-inf"), ranked)
    if RENORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, 1)[:, None] + 1e-20)
    m = m_t[:, None] & (o_j < K)[None, :]
    tl.store(weights + o_t[:, None] * K + o_j[None, :], chosen_w * scaling, mask=m)
    tl.store(ids + o_t[:, None] * K + o_j[None, :], chosen_e.to(tl.int64), mask=m)


def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
              renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `ops.moe.eager.moe_route`: x [T, D], gate_weight [E, D], correction_bias [E] ->
    (weights [T, k] fp32, expert ids [T, k] int64)."""
    op = "moe_route"
    check(op, "x", x, dims=2)
    check(op, "gate_weight", gate_weight, dtypes=(x.dtype,), dims=2)
    check(op, "correction_bias", correction_bias, dims=1)
    t, d = x.shape
    e = gate_weight.shape[0]
    if gate_weight.shape[1] != d or correction_bias.shape[0] != e or not 0 < top_k <= e or top_k > 64:
        raise TritonKernelError(f"{op}: gate_weight {tuple(gate_weight.shape)}, bias {tuple(correction_bias.shape)}, "
                                f"top_k {top_k} do not fit x {tuple(x.shape)} (top_k at most 64 and E)")
    if e > 4096:
        raise TritonKernelError(f"{op}: {e} experts do not fit the per-token register tile (at most 4096)")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)
    bt = 16 if t <= 256 else 64
    be = 16 if t <= 256 else 64  # a lone decode token still spreads over E / 16 programs
    _router_logits_kernel[(triton.cdiv(t, bt), triton.cdiv(e, be))](
        x, gate_weight, logits, t, d, e, x.stride(0), gate_weight.stride(0), logits.stride(0),
        BT=bt, BE=be, BK=128 if t <= 256 else 64, DOT_FP32=interpreting(),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3)
    e_pad = pow2_at_least(e, 16)
    bt2 = max(1, min(64, 4096 // e_pad))
    _router_topk_kernel[(triton.cdiv(t, bt2),)](
        logits, correction_bias, weights, ids, t, e, logits.stride(0), float(scaling),
        K=top_k, K_PAD=pow2_at_least(top_k, 2), BT=bt2, E_PAD=e_pad, RENORMALIZE=bool(renormalize), num_warps=4)
    return weights, ids


moe_route.graph_safe = True  # no host sync; grids from shapes only
