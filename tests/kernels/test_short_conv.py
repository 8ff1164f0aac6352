"""Triton short conv (prefill and decode) against the eager op, with a NaN-poisoned conv-state pool.

Prefill tiles take one of two paths: inside one sequence (rows loaded once, no state) or at a sequence start or
boundary (token by token, with state reads). The cases mix both: sequences shorter than W-1,
boundaries inside a tile, a tile that is the last of its program, C that is and is not a multiple of the channel
block, and tilings other than the default (small tiles make almost every path appear in a short batch).
"""

from __future__ import annotations

import pytest
import torch

from shard_svc.ops import conv
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, assert_unused_untouched, cu_seqlens, poisoned_pool

# (lens, channels, width, x dtype, state dtype)
CASES = {
    "prefill-varlen-5,1,40-C48-W4": ([5, 1, 40], 48, 4, torch.float32, torch.float32),
    "prefill-varlen-2,33,1-C200-W4-bf16": ([2, 33, 1], 200, 4, torch.bfloat16, torch.bfloat16),
    "prefill-one-70-C130-W3": ([70], 130, 3, torch.float32, torch.float32),
    "prefill-short-seqs-C200-W4-bf16": ([1, 2, 3, 1, 17, 2, 40, 5, 9], 200, 4, torch.bfloat16, torch.bfloat16),
    "prefill-varlen-3,21,1-C96-W4": ([3, 21, 1], 96, 4, torch.float32, torch.float32),
    "prefill-even-C256-W4-bf16": ([37, 64], 256, 4, torch.bfloat16, torch.bfloat16),
    "prefill-even-C512-W2-bf16-fp32-state": ([1, 50], 512, 2, torch.bfloat16, torch.float32),
    "decode-N4-C48-W4": ([1, 1, 1, 1], 48, 4, torch.float32, torch.float32),
    "decode-N3-C300-W4-bf16": ([1, 1, 1], 300, 4, torch.bfloat16, torch.bfloat16),
}
if ON_GPU:
    CASES["gpu-prefill-1000,3000-C12288-W4-bf16"] = ([1000, 3000], 12288, 4, torch.bfloat16, torch.bfloat16)
    CASES["gpu-prefill-8x4096-C12288-W4-bf16"] = ([4096] * 8, 12288, 4, torch.bfloat16, torch.bfloat16)
    CASES["gpu-decode-N256-C12288-W4-bf16"] = ([1] * 256, 12288, 4, torch.bfloat16, torch.bfloat16)

# prefill tiling overrides (block_t, tiles_per_program, num_warps); None = the launcher's choice
TILINGS = {
    "default": {},
    "bt1-x5": dict(block_t=1, tiles_per_program=5),
    "bt3-x2": dict(block_t=3, tiles_per_program=2),
    "bt4-x1-w1": dict(block_t=4, tiles_per_program=1, num_warps=1),
    "bt16-x3-w2": dict(block_t=16, tiles_per_program=3, num_warps=2),
}


def run_case(lens, c, width, dtype, sdtype, x_stride_pad: int = 0, **tiling):
    from shard_svc.ops.triton.short_conv import short_conv

    g = torch.Generator().manual_seed(0)
    num_slots = len(lens) + 3
    # x_stride_pad > 0: x is a column slice of a wider buffer (rows not contiguous with each other)
    x = torch.randn(sum(lens), c + x_stride_pad, generator=g).to(DEVICE, dtype)[:, :c]
    weight = (torch.randn(c, width, generator=g) * 0.5).to(DEVICE, dtype)
    slots = torch.randperm(num_slots, generator=g)[: len(lens)].to(DEVICE)
    pool = poisoned_pool((num_slots, c, width - 1), slots, dtype=sdtype, scale=1.0)
    ours, ref_pool = pool.clone(), pool.clone()
    out = short_conv(x, weight, ours, slots, cu_seqlens(lens), **tiling)
    ref = conv.short_conv(x, weight, ref_pool, slots, cu_seqlens(lens))
    tol = 1e-2 if dtype != torch.float32 else 1e-6
    assert out.dtype == x.dtype
    assert_close("out", out, ref, tol)
    assert torch.equal(ours[slots], ref_pool[slots]), "new conv state differs (it is a copy of inputs)"
    assert_unused_untouched("conv state", ours, slots)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_short_conv_matches_eager(case):
    run_case(*CASES[case])


@pytest.mark.parametrize("tiling", list(TILINGS), ids=list(TILINGS))
@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("prefill")])
def test_short_conv_prefill_tilings(case, tiling):
    run_case(*CASES[case], **TILINGS[tiling])


def test_short_conv_strided_rows():
    run_case([6, 30], 64, 4, torch.float32, torch.float32, x_stride_pad=24, block_t=4)


def test_short_conv_rejects_bad_tiling():
    from shard_svc.ops.triton.common import TritonKernelError

    with pytest.raises(TritonKernelError, match="block_t 0"):
        run_case([5, 9], 32, 4, torch.float32, torch.float32, block_t=0)
