"""Skinny GEMM for decode-sized linears: y[M, N] = x[M, K] @ w[N, K]^T with M <= 16, and the `linear` op.

Reference: `torch.nn.functional.linear` (the eager `linear` op). With a handful of rows a linear layer is a read of
its weight, so the kernel is shaped for bandwidth, not FLOPs: the weight's rows are the long side of the tile
(w[BN, BK] @ x^T[BK, 16]: the 16 padded token rows are the short side, their padding loads nothing), the grid runs
over N blocks sized so that the model's shapes give at least one program per SM (two where N allows), each program
streams wide K steps (8-16 KB of weight per step) through a multi-stage software pipeline so several loads are in
flight, and when N is too small to fill the SMs the K range is split over programs whose fp32 partial sums a second,
small launch adds up in a fixed order (deterministic: no atomics). Accumulation is fp32; products of bf16/fp16
inputs are exact in fp32, so the result differs from cuBLAS only by summation order before the one rounding to x's
dtype. Block sizes come from shapes alone and nothing syncs with the host: graph-safe.

`linear` (the op-seam name) is a shape dispatch between two correct paths, not a fallback: 2-D inputs of at most
`DISPATCH_MAX_M` rows with a contiguous weight run the skinny kernel, everything else (prefill) runs F.linear,
which cuBLAS already serves near peak at large M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from shard_svc.ops.triton.common import (TritonKernelError, check, dot_precision, interpreting, pdl_args, pow2_at_least,
                                         sm_count)
from shard_svc.ops.triton.jit_helpers import dot_k_loop, pdl_prologue, round_to

MAX_M = 16  # rows the skinny kernel takes: one padded tile side of tl.dot
# Rows up to which the `linear` op dispatches to it. H200, one decode step's 243 linears replayed as one CUDA graph
# (bench/linear_micro.py): ours 1.86 vs cuBLAS 2.24 ms at M=1 and 1.86 vs 1.98 at M=4, but 1.90 vs 1.86 at M=16.
DISPATCH_MAX_M = 4
BLOCK_M = 16  # tl.dot's smallest tile side; the masked padding rows read no memory
TILE_BYTES = 16 * 1024  # weight bytes per K step of one program
# Narrow tiles (block_n < 64) run mma.sync, which holds a program's whole [block_n, block_k] weight tile in every
# warp's registers: at 512 the sm_90 compile of block_n 16 needed 255 registers and spilled (offline ptxas check).
MAX_BLOCK_K = 256
SMEM_PER_PROGRAM = 96 * 1024  # pipelined tiles of one program, so two programs share an H200 SM (227 KB)
SPLIT_STEP_BYTES = 256  # bytes of each weight row per K step when K is split (short ranges, many programs)
MIN_STEPS_PER_SPLIT = 2
MAX_SPLITS = 32
REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int  # weight rows (output columns) per program
    block_k: int  # K elements per pipelined step
    splits: int  # K ranges, each its own program; > 1 adds the reduction launch
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_kernel(x, w, out, M, N, K, k_split, stride_xm, stride_xk, stride_wn, stride_om, stride_os,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    o_n = pid_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    # Rows past N re-read row N-1 instead of masking: unmasked weight loads stay fully vectorised; never stored.
    o_w = tl.minimum(o_n, N - 1).to(tl.int64)
    o_m = tl.arange(0, BM)
    m_m = o_m < M
    o_k = tl.arange(0, BK)
    k_lo = pid_s * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    p_w = w + o_w[:, None] * stride_wn + (k_lo + o_k)[None, :]  # [BN, BK]
    p_x = x + o_m[None, :] * stride_xm + (k_lo + o_k)[:, None] * stride_xk  # [BK, BM]
    acc = dot_k_loop(tl.zeros([BN, BM], dtype=tl.float32), p_w, p_x, m_m, o_k, k_lo, k_hi, stride_xk,
                     BK, EVEN_K, DOT_FP32, PRECISION)
    p_o = out + pid_s.to(tl.int64) * stride_os + o_m[None, :] * stride_om + o_n[:, None]
    tl.store(p_o, round_to(acc, out.dtype.element_ty, RNE), mask=m_n[:, None] & m_m[None, :])


@triton.jit
def _splitk_reduce_kernel(part, y, N, S, stride_ps, stride_pm, stride_ym, BR: tl.constexpr, RNE: tl.constexpr,
                          PDL: tl.constexpr):
    pdl_prologue(PDL)
    o_n = tl.program_id(0) * BR + tl.arange(0, BR)
    m = tl.program_id(1).to(tl.int64)
    m_n = o_n < N
    acc = tl.zeros([BR], dtype=tl.float32)
    for s in range(0, S):  # a fixed order: the same sum every run
        acc += tl.load(part + s * stride_ps + m * stride_pm + o_n, mask=m_n, other=0.0)
    tl.store(y + m * stride_ym + o_n, round_to(acc, y.dtype.element_ty, RNE), mask=m_n)


# -- host side -----------------------------------------------------------------------------------------------------

def _largest_pow2_divisor(k: int, cap: int) -> int:
    d = 1
    while d < cap and k % (d * 2) == 0:
        d *= 2
    return d


def _block_k(k: int, block_n: int, elem: int) -> int:
    """K step: about TILE_BYTES of weight (at most MAX_BLOCK_K), preferring a power of two that divides K (no mask)."""
    want = max(16, min(MAX_BLOCK_K, TILE_BYTES // (block_n * elem)))
    even = _largest_pow2_divisor(k, want)
    return even if even >= 16 else min(want, pow2_at_least(k, 16))


def _stages(block_n: int, block_k: int, elem: int) -> int:
    per_stage = (block_n + BLOCK_M) * block_k * elem
    return max(2, min(4, SMEM_PER_PROGRAM // per_stage))


def tile_config(k: int, elem: int, block_n: int, splits: int) -> SkinnyConfig:
    """The K step and pipeline depth for a chosen N block and split count: about TILE_BYTES of weight per step
    when K is whole, SPLIT_STEP_BYTES per row when it is split (short ranges over many programs)."""
    if splits > 1:
        block_k = max(16, min(pow2_at_least(k, 16), SPLIT_STEP_BYTES // elem))
    else:
        block_k = _block_k(k, block_n, elem)
    return SkinnyConfig(block_n, block_k, splits, num_stages=_stages(block_n, block_k, elem))


def skinny_config(n: int, k: int, elem: int, sms: int) -> SkinnyConfig:
    """Tiles for an [N, K] weight on a device with `sms` SMs (from shapes only: graph-safe).

    The widest N block that still gives two programs per SM; failing that 16 rows. When even that leaves SMs idle
    (N < 16 * sms: the small projections) K is split so there are about two programs per SM, each with at least
    MIN_STEPS_PER_SPLIT steps; between one and two programs per SM K stays whole (a second launch costs about what
    it would win)."""
    target = 2 * sms
    block_n = next((b for b in (128, 64, 32) if triton.cdiv(n, b) >= target), 16)
    n_blocks = triton.cdiv(n, block_n)
    splits = 1
    if n_blocks < sms:
        k_steps = triton.cdiv(k, tile_config(k, elem, block_n, 2).block_k)
        splits = max(1, min(triton.cdiv(target, n_blocks), k_steps // MIN_STEPS_PER_SPLIT, MAX_SPLITS))
        splits = triton.cdiv(k_steps, triton.cdiv(k_steps, splits))  # equal whole-step ranges, none empty
    return tile_config(k, elem, block_n, splits)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, any strides), weight [N, K] with contiguous rows -> x @ weight^T [M, N] in x's dtype.

    `config` overrides the tiles chosen by `skinny_config` (benchmark sweeps, tests of the split path)."""
    op = "linear"
    # A streamed weight without a device slot (streaming's UnboundWeight) raises MissingSlotError on any use:
    # touch it before the device checks, so that error, naming the tensor, is the one a caller sees.
    weight.data_ptr()
    check(op, "x", x, dims=2, last_contiguous=False)
    check(op, "weight", weight, dtypes=(x.dtype,), dims=2)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise TritonKernelError(f"{op}: weight {tuple(weight.shape)} does not match x {tuple(x.shape)} "
                                f"(expected [N, {k}])")
    if m > MAX_M:
        raise TritonKernelError(f"{op}: x {tuple(x.shape)} has {m} rows; the skinny kernel takes at most {MAX_M} "
                                f"(larger M is the F.linear side of the `linear` dispatch)")
    if x.device != weight.device:
        raise TritonKernelError(f"{op}: x on {x.device} and weight on {weight.device}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    cfg = config or skinny_config(n, k, x.element_size(), sm_count(x.device))
    k_split = triton.cdiv(triton.cdiv(k, cfg.splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_split)
    even_k = k % cfg.block_k == 0
    rne = interpreting() and x.dtype == torch.bfloat16
    out = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    stride_os = 0 if splits == 1 else out.stride(0)
    _skinny_kernel[(triton.cdiv(n, cfg.block_n), splits)](
        x, weight, out, m, n, k, k_split, x.stride(0), x.stride(1), weight.stride(0), out.stride(-2), stride_os,
        BM=BLOCK_M, BN=cfg.block_n, BK=cfg.block_k, EVEN_K=even_k, DOT_FP32=interpreting(),
        PRECISION=dot_precision(x.dtype), RNE=rne and splits == 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device))
    if splits > 1:
        br = min(REDUCE_BLOCK, pow2_at_least(n, 128))
        _splitk_reduce_kernel[(triton.cdiv(n, br), m)](
            out, y, n, splits, out.stride(0), out.stride(1), y.stride(0), BR=br, RNE=rne, num_warps=4,
            **pdl_args(x.device))
    return y


def uses_skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The `linear` dispatch rule: which of the two paths serves these shapes."""
    return x.dim() == 2 and x.shape[0] <= DISPATCH_MAX_M and (x.is_cuda or interpreting()) and weight.is_contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Same contract as the eager `linear` op (F.linear without bias): x [..., K], weight [N, K] -> [..., N].

    Shape dispatch between two correct paths: decode-sized 2-D inputs (at most DISPATCH_MAX_M rows, contiguous
    weight) run `skinny_linear`, everything else F.linear (cuBLAS). Which path a call takes is
    `uses_skinny(x, weight)`."""
    if uses_skinny(x, weight):
        return skinny_linear(x, weight)
    return F.linear(x, weight)


linear.graph_safe = True  # both paths: no host sync, buffers and grids from shapes only
