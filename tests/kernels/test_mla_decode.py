"""Triton absorbed MLA decode against the eager (non-absorbed) MLA attention.

Decode layout: one new token per sequence, already in the cache at position ctx_lens[b]. Head counts that are not
powers of two, latent and rope widths off the power-of-two grid, sequences of one token and sequences spanning many
blocks in shuffled block tables, one split and many (split-K), and a cache whose unused blocks and unused positions
are NaN (they must never be read).
"""

from __future__ import annotations


import pytest
import torch

from shard_svc.ops.mla import eager
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, kernel_module

# (ctx_lens, nh, nope, rope, v, kv_lora, block_size, dtype, splits or None for the automatic choice)
CASES = {
    "B1-ctx0-H3-one-token": ([0], 3, 16, 8, 16, 32, 4, torch.float32, None),
    "B3-H5-odd-latent-splits3": ([5, 37, 0], 5, 16, 8, 24, 40, 4, torch.float32, 3),
    "B2-H16-block16-auto-splits": ([100, 17], 16, 16, 16, 16, 32, 16, torch.float32, None),
    "B4-H20-two-head-blocks": ([9, 63, 64, 1], 20, 8, 16, 8, 48, 8, torch.float32, 2),
    "B2-H4-one-split-long": ([77, 130], 4, 16, 8, 16, 32, 16, torch.float32, 1),
    "B3-H6-bf16-splits4": ([40, 3, 90], 6, 32, 16, 32, 64, 16, torch.bfloat16, 4),
}
if ON_GPU:
    CASES.update({
        f"gpu-B{b}-kimi-48b-bf16": ([4095 - 37 * i for i in range(b)], 32, 128, 64, 128, 512, 64, torch.bfloat16,
                                    None)
        for b in (1, 16, 64)
    })
    CASES["gpu-B2-H8-32k-bf16"] = ([32767, 1000], 8, 128, 64, 128, 512, 16, torch.bfloat16, None)


# fp32 dot operands run as TF32 on the GPU's tensor cores (measured on the H200: up to 1.2e-3 against eager); exact
# fp32 in the interpreter.
FP32_TOL = 3e-3 if ON_GPU else 1e-5


def mla_module():
    return kernel_module("mla_decode", "_mla_decode_kernel", shares_from=("jit_helpers",))


def make_decode_batch(ctx_lens, nh, nope, rope, v_dim, kv_lora, block_size, dtype, seed=0, spare_blocks=3):
    """A decode step's inputs; blocks and positions that no sequence uses hold NaN."""
    g = torch.Generator().manual_seed(seed)
    b = len(ctx_lens)
    need = [-(-(c + 1) // block_size) for c in ctx_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 1  # one padding column past the longest table
    tables = torch.zeros(b, width, dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, kv_lora + rope), float("nan"))
    at = 0
    for i, c in enumerate(ctx_lens):
        blocks = perm[at:at + need[i]]
        at += need[i]
        tables[i, :need[i]] = torch.tensor(blocks, dtype=torch.int32)
        flat = cache[blocks].reshape(-1, kv_lora + rope)
        flat[: c + 1] = torch.randn(c + 1, kv_lora + rope, generator=g)
        cache[blocks] = flat.view(need[i], block_size, -1)
    q = torch.randn(b, nh, nope + rope, generator=g)
    w_kv_b = torch.randn(nh * (nope + v_dim), kv_lora, generator=g) * kv_lora**-0.5
    cu = torch.arange(b + 1, dtype=torch.int64)
    return (q[..., :nope].to(DEVICE, dtype), q[..., nope:].to(DEVICE, dtype), cache.to(DEVICE, dtype),
            w_kv_b.to(DEVICE, dtype), tables.to(DEVICE), torch.tensor(ctx_lens, dtype=torch.int64, device=DEVICE),
            cu.to(DEVICE))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_mla_decode_matches_eager(case):
    mod = mla_module()
    ctx_lens, nh, nope, rope, v_dim, kv_lora, bs, dtype, splits = CASES[case]
    q_nope, q_pe, cache, w_kv_b, tables, ctx, cu = make_decode_batch(ctx_lens, nh, nope, rope, v_dim, kv_lora, bs,
                                                                     dtype)
    scale = (nope + rope) ** -0.5
    before = cache.clone()
    out = mod.mla_decode(q_nope, q_pe, cache, w_kv_b, tables, ctx, cu, scale, num_splits=splits)
    ref = eager.mla_attention(q_nope, q_pe, cache, w_kv_b, tables, ctx, cu, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(f"mla_decode {case}", out, ref, 2e-2 if dtype != torch.float32 else FP32_TOL)
    assert torch.equal(cache.isnan(), before.isnan()), "the cache must not be written"


def test_mla_decode_splits_agree():
    """Every split count gives the same result, including more splits than a short sequence has tiles."""
    mod = mla_module()
    args = make_decode_batch([70, 2], 4, 16, 8, 16, 32, 8, torch.float32, seed=2)
    scale = 24**-0.5
    one = mod.mla_decode(*args, scale, num_splits=1)
    for splits in (2, 5, 8):
        assert_close(f"splits={splits}", mod.mla_decode(*args, scale, num_splits=splits), one, FP32_TOL)


@pytest.mark.parametrize("block_n,num_stages,waves", [(64, 3, 4), (16, 1, 8)])
def test_mla_decode_layouts_agree(block_n, num_stages, waves):
    """The layout knobs the benchmark sweeps (token tile, pipeline depth, split waves) change no result."""
    mod = mla_module()
    args = make_decode_batch([70, 2, 130], 4, 16, 8, 16, 32, 8, torch.float32, seed=3)
    scale = 24**-0.5
    ref = eager.mla_attention(*args, scale)
    out = mod.mla_decode(*args, scale, block_n=block_n, num_stages=num_stages, waves=waves)
    assert_close(f"block_n={block_n} stages={num_stages} waves={waves}", out, ref, FP32_TOL)


def test_mla_decode_split_choice_is_from_shapes():
    mod = mla_module()
    assert mod.num_splits_for(1, 1, 4160, 132) == mod.MAX_SPLITS
    assert mod.num_splits_for(256, 1, 4160, 132) == 2
    assert mod.num_splits_for(1, 1, 20, 132) == 1  # never more splits than token tiles


def test_mla_decode_refuses_prefill_layout():
    mod = mla_module()
    q_nope, q_pe, cache, w_kv_b, tables, ctx, _ = make_decode_batch([3, 4], 2, 16, 8, 16, 32, 4, torch.float32)
    two_tokens = torch.cat([q_nope, q_nope])
    with pytest.raises(mod.TritonKernelError, match="one token per sequence"):
        mod.mla_decode(two_tokens, torch.cat([q_pe, q_pe]), cache, w_kv_b, tables, ctx,
                       torch.tensor([0, 2, 4], device=DEVICE), 0.2)


def test_op_seam_serves_triton_mla_decode():
    from shard_svc.ops import select_ops

    mla_module()
    ops = select_ops(DEVICE, "triton")
    assert dict(ops.backends)["mla_decode"] == "triton"
    assert getattr(ops.mla_decode, "graph_safe", False)
