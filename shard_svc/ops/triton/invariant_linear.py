"""A GEMM whose every output row is the same bits whatever the number of rows: the `linear` of batch-invariant mode.

Why: a prefix-cache restore prefills a prompt's tail in a short pass of its own, and cuBLAS picks its kernel (tiles,
split-K) by the product's M, so the tail's rows round differently from the same rows inside one pass over the whole
prompt (README "Split invariance"; bench/split_divergence.py named `linear` first on the H100). Here one tiling
serves every M: each output element is the same fp32 sum over K, in BK steps in the same order, whether its row
shares the pass with 40 others or with 4,000, so the rows agree bit for bit. It is slower than cuBLAS at large M
(no library-tuned tiles), which is why it serves only `--batch-invariant` shards.

Reference: `torch.nn.functional.linear` (the eager `linear` op); the tests compare the two and check the invariance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, dot_precision, interpreting
from shard_svc.ops.triton.jit_helpers import dot_k_loop, round_to
from shard_svc.ops.triton.moe import tile_ids

# One tiling for every M (the invariance depends on it); the interpreter's is small so CPU tests stay quick.
GPU_TILES = (128, 128, 64, 8, 3)  # BM, BN, BK, warps, stages
INTERPRETER_TILES = (16, 32, 32, 4, 1)
GROUP_M = 8


@triton.jit
def _invariant_gemm_kernel(x, w, y, M, N, K, stride_xm, stride_wn, stride_ym,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                           EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
                           RNE: tl.constexpr):
    pid_m, pid_n = tile_ids(tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP)
    o_m = pid_m * BM + tl.arange(0, BM)
    o_n = pid_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    # Rows and columns past the ends re-read the last one (loads stay unmasked along M and N); never stored.
    p_x = x + tl.minimum(o_m, M - 1).to(tl.int64)[:, None] * stride_xm + o_k[None, :]  # [BM, BK]
    p_w = w + tl.minimum(o_n, N - 1).to(tl.int64)[None, :] * stride_wn + o_k[:, None]  # [BK, BN]
    acc = dot_k_loop(tl.zeros([BM, BN], dtype=tl.float32), p_x, p_w, o_n < N, o_k, 0, K, 1,
                     BK, EVEN_K, DOT_FP32, PRECISION)
    p_y = y + o_m.to(tl.int64)[:, None] * stride_ym + o_n[None, :]
    tl.store(p_y, round_to(acc, y.dtype.element_ty, RNE), mask=(o_m < M)[:, None] & (o_n < N)[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Same contract as the eager `linear` op (F.linear without bias): x [..., K], weight [N, K] -> [..., N] in x's
    dtype, each row computed alike for any number of rows. `tiles` (BM, BN, BK, warps, stages) overrides the one
    tiling (the sm_90 compile test records the GPU's under the interpreter)."""
    op = "linear"
    weight.data_ptr()  # a streamed weight without a slot raises its own named error here (see linear.py)
    check(op, "weight", weight, dtypes=(x.dtype,), dims=2)
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise TritonKernelError(f"{op}: weight {tuple(weight.shape)} does not match x {tuple(x.shape)} "
                                f"(expected [N, {k}])")
    rows = x.reshape(-1, k)
    check(op, "x", rows, dims=2)
    m = rows.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        if k == 0:
            y.zero_()
        else:
            bm, bn, bk, warps, stages = tiles or (INTERPRETER_TILES if interpreting() else GPU_TILES)
            _invariant_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
                rows, weight, y, m, n, k, rows.stride(0), weight.stride(0), y.stride(0),
                BM=bm, BN=bn, BK=bk, GROUP=GROUP_M, EVEN_K=k % bk == 0, DOT_FP32=interpreting(),
                PRECISION=dot_precision(x.dtype), RNE=interpreting() and x.dtype == torch.bfloat16,
                num_warps=warps, num_stages=stages)
    return y.reshape(*x.shape[:-1], n)


invariant_linear.graph_safe = True  # no host sync; grid from shapes only
