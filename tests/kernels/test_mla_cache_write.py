"""The Triton MLA cache write (norm, join, indexed write in one launch) against the eager op."""

from __future__ import annotations

import pytest
import torch

from shard_svc.ops.mla import eager
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, kernel_module

# (tokens, kv_lora, rope, latent dtype, cache dtype, weight dtype)
CASES = {
    "T1-L16-R8-fp32": (1, 16, 8, torch.float32, torch.float32, torch.float32),
    "T7-L40-R12-bf16": (7, 40, 12, torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "T5-L32-R8-bf16-fp32-weight": (5, 32, 8, torch.bfloat16, torch.bfloat16, torch.float32),
}
if ON_GPU:
    CASES["gpu-T300-L512-R64-bf16"] = (300, 512, 64, torch.bfloat16, torch.bfloat16, torch.bfloat16)


def cache_module():
    return kernel_module("mla_cache", "_mla_cache_write_kernel", shares_from=("jit_helpers",))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_mla_cache_write_matches_eager(case):
    t, kv_lora, rope, dtype, cache_dtype, wdtype = CASES[case]
    g = torch.Generator().manual_seed(4)
    # c_kv and k_pe as the column views of one kv_a projection, as the model passes them
    kv_a = torch.randn(t, kv_lora + rope, generator=g).to(DEVICE, dtype)
    c_kv, k_pe = kv_a.split([kv_lora, rope], dim=-1)
    weight = (1 + 0.1 * torch.randn(kv_lora, generator=g)).to(DEVICE, wdtype)
    blocks, block_size = 2 * t + 3, 4
    slots = torch.randperm(blocks * block_size, generator=g)[:t].to(DEVICE)
    cache = torch.full((blocks, block_size, kv_lora + rope), float("nan"), dtype=cache_dtype, device=DEVICE)
    ref = cache.clone()
    cache_module().mla_cache_write(cache, c_kv, k_pe, weight, 1e-6, slots)
    eager.mla_cache_write(ref, c_kv, k_pe, weight, 1e-6, slots)
    flat, ref_flat = cache.view(-1, kv_lora + rope), ref.view(-1, kv_lora + rope)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert flat[untouched].isnan().all(), "a slot outside slot_mapping was written"
    assert torch.equal(flat[slots, kv_lora:], ref_flat[slots, kv_lora:]), "the rope keys must be copied exactly"
    assert_close(f"normed latent {case}", flat[slots, :kv_lora], ref_flat[slots, :kv_lora],
                 1e-2 if dtype != torch.float32 else 1e-6)


def test_mla_cache_write_refuses_a_cache_of_another_width():
    from shard_svc.ops.triton.common import TritonKernelError

    c_kv, k_pe = torch.randn(2, 16, device=DEVICE), torch.randn(2, 8, device=DEVICE)
    cache = torch.zeros(4, 4, 20, device=DEVICE)
    with pytest.raises(TritonKernelError, match=r"do not fit kv_cache \(4, 4, 20\)"):
        cache_module().mla_cache_write(cache, c_kv, k_pe, torch.ones(16, device=DEVICE), 1e-6,
                                       torch.tensor([0, 1], device=DEVICE))
