"""Sigmoid top-k router: two launches instead of the eager path's dozen small ones.

Reference: `shard_svc/ops/moe/eager.py::moe_route`. `_router_logits_kernel` computes x W_gate^T with fp32
accumulation (products of bf16 inputs are exact in fp32, as in the eager path's upcast GEMM; only the summation
order differs), tiled over tokens and experts. With few tokens those tiles alone are too few programs to stream the
gate weight (E/16 for a decode token), so the hidden dimension is also split over a third grid axis; each split
writes its partial logits and `_router_topk_kernel` adds them in a fixed order (deterministic, no atomics).
`_router_topk_kernel` then takes, per token, the sigmoid, chooses the top k by score + correction bias (one
arg-max per choice, ties to the lower expert id as torch.topk), gathers the unbiased scores of the chosen experts,
renormalises (+1e-20) and scales; its tile has as many rows as the batch needs (up to the register budget) and
fewer warps when it is small. No host sync: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, dot_precision, interpreting, pdl_args, pow2_at_least
from shard_svc.ops.triton.jit_helpers import pdl_prologue


@triton.jit(do_not_specialize=["T"])  # the pass's tokens: one variant for all
def _router_logits_kernel(x, w, logits, T, D, E, k_span, stride_x, stride_w, stride_l, stride_split,
                          BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
                          PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    o_e = tl.program_id(1) * BE + tl.arange(0, BE)
    m_t = o_t < T
    m_e = o_e < E
    o_k = tl.arange(0, BK)
    k_lo = tl.program_id(2) * k_span  # this program's part of the hidden dimension
    k_hi = tl.minimum(k_lo + k_span, D)
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        m_k = (k0 + o_k) < k_hi
        a = tl.load(x + o_t[:, None] * stride_x + (k0 + o_k)[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b = tl.load(w + o_e[None, :].to(tl.int64) * stride_w + (k0 + o_k)[:, None],
                    mask=m_k[:, None] & m_e[None, :], other=0.0)  # [BK, BE]
        if DOT_FP32:  # the interpreter multiplies bf16 dot operands wrongly
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(logits + tl.program_id(2).to(tl.int64) * stride_split + o_t[:, None] * stride_l + o_e[None, :], acc,
             mask=m_t[:, None] & m_e[None, :])


@triton.jit(do_not_specialize=["T"])  # the pass's tokens: one variant for all
def _router_topk_kernel(logits, bias, weights, ids, T, E, stride_l, stride_split, scaling,
                        K: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr, E_PAD: tl.constexpr,
                        SPLIT: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    o_t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_e = tl.arange(0, E_PAD)
    m_e = o_e < E
    p_l = logits + o_t[:, None] * stride_l + o_e[None, :]
    m_l = m_t[:, None] & m_e[None, :]
    logit = tl.load(p_l, mask=m_l, other=0.0)
    for s in tl.static_range(1, SPLIT):  # unrolled: the partial tiles are requested together
        logit += tl.load(p_l + s * stride_split, mask=m_l, other=0.0)
    score = tl.sigmoid(logit)
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


# Programs the logits launch aims for at small T: about two per SM of an H100/H200 (132 SMs).
_MIN_PROGRAMS = 256


def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
              renormalize: bool, scaling: float, *, split_k: int | None = None,
              topk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `ops.moe.eager.moe_route`: x [T, D], gate_weight [E, D], correction_bias [E] ->
    (weights [T, k] fp32, expert ids [T, k] int64).

    `split_k` overrides how many parts the hidden dimension is split into, `topk_rows` how many tokens one top-k
    program takes (a power of two; benchmarks and tests)."""
    op = "moe_route"
    check(op, "x", x, dims=2)
    check(op, "gate_weight", gate_weight, dtypes=(x.dtype,), dims=2)
    check(op, "correction_bias", correction_bias, dims=1)
    t, d = x.shape
    e = gate_weight.shape[0]
    if gate_weight.shape[1] != d or correction_bias.shape[0] != e or not 0 < top_k <= e or top_k > 64:
        raise TritonKernelError(f"{op}: gate_weight {tuple(gate_weight.shape)}, bias {tuple(correction_bias.shape)}, "
                                f"top_k {top_k} do not fit x {tuple(x.shape)} (top_k at most 64 and E)")
    if topk_rows is not None and (topk_rows < 1 or topk_rows & (topk_rows - 1)):
        raise TritonKernelError(f"{op}: topk_rows {topk_rows} must be a power of two")
    if e > 4096:
        raise TritonKernelError(f"{op}: {e} experts do not fit the per-token register tile (at most 4096)")
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return weights, ids
    small = t <= 256
    bt, be, bk = (16, 16, 128) if small else (64, 64, 64)  # 16 x 16: the smallest tl.dot tile
    k_steps = triton.cdiv(d, bk)
    if split_k is not None:
        if split_k < 1:
            raise TritonKernelError(f"{op}: split_k {split_k} must be >= 1")
        split = min(split_k, k_steps)
    elif small:  # split D until there are about _MIN_PROGRAMS programs, at least two BK steps each
        split = max(1, min(triton.cdiv(_MIN_PROGRAMS, triton.cdiv(t, bt) * triton.cdiv(e, be)), k_steps // 2))
    else:
        split = 1
    k_span = triton.cdiv(k_steps, split) * bk
    split = triton.cdiv(d, k_span)  # no empty split
    logits = torch.empty(split, t, e, dtype=torch.float32, device=x.device)
    _router_logits_kernel[(triton.cdiv(t, bt), triton.cdiv(e, be), split)](
        x, gate_weight, logits, t, d, e, k_span, x.stride(0), gate_weight.stride(0), logits.stride(1),
        logits.stride(0), BT=bt, BE=be, BK=bk, DOT_FP32=interpreting(),
        PRECISION=dot_precision(x.dtype), num_warps=4, num_stages=3, **pdl_args(x.device))
    e_pad = pow2_at_least(e, 16)
    bt2 = topk_rows or min(pow2_at_least(t), max(1, min(64, 4096 // e_pad)))  # rows per program: at most the batch
    _router_topk_kernel[(triton.cdiv(t, bt2),)](
        logits, correction_bias, weights, ids, t, e, logits.stride(1), logits.stride(0), float(scaling),
        K=top_k, K_PAD=pow2_at_least(top_k, 2), BT=bt2, E_PAD=e_pad, SPLIT=split, RENORMALIZE=bool(renormalize),
        num_warps=max(1, min(4, bt2 * e_pad // 1024)),  # at most 32 scores per thread; one warp for a decode token
        **pdl_args(x.device))
    return weights, ids


moe_route.graph_safe = True  # no host sync; grids from shapes only
