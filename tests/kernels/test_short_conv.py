"""Triton short conv (prefill and decode) against the eager op, with a NaN-poisoned conv-state pool."""

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
    "decode-N4-C48-W4": ([1, 1, 1, 1], 48, 4, torch.float32, torch.float32),
    "decode-N3-C300-W4-bf16": ([1, 1, 1], 300, 4, torch.bfloat16, torch.bfloat16),
}
if ON_GPU:
    CASES["gpu-prefill-1000,3000-C12288-W4-bf16"] = ([1000, 3000], 12288, 4, torch.bfloat16, torch.bfloat16)
    CASES["gpu-decode-N256-C12288-W4-bf16"] = ([1] * 256, 12288, 4, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_short_conv_matches_eager(case):
    from shard_svc.ops.triton.short_conv import short_conv

    lens, c, width, dtype, sdtype = CASES[case]
    g = torch.Generator().manual_seed(0)
    num_slots = len(lens) + 3
    x = torch.randn(sum(lens), c, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(c, width, generator=g) * 0.5).to(DEVICE, dtype)
    slots = torch.randperm(num_slots, generator=g)[: len(lens)].to(DEVICE)
    pool = poisoned_pool((num_slots, c, width - 1), slots, dtype=sdtype, scale=1.0)
    ours, ref_pool = pool.clone(), pool.clone()
    out = short_conv(x, weight, ours, slots, cu_seqlens(lens))
    ref = conv.short_conv(x, weight, ref_pool, slots, cu_seqlens(lens))
    tol = 1e-2 if dtype != torch.float32 else 1e-6
    assert out.dtype == x.dtype
    assert_close("out", out, ref, tol)
    assert torch.equal(ours[slots], ref_pool[slots]), "new conv state differs (it is a copy of inputs)"
    assert_unused_untouched("conv state", ours, slots)
