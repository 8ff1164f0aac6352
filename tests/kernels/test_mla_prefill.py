"""Triton MLA prefill (flash-style, causal, varlen, cached prefix) against the eager MLA attention.

Sequences with and without a cached prefix (chunked prefill), lengths off the query and key tile grid, empty
sequences, head counts that are not powers of two, rope/latent widths below a tensor-core tile, shuffled block
tables, and a cache whose unused blocks and positions are NaN.
"""

from __future__ import annotations


import pytest
import torch

from shard_svc.ops.mla import eager
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, kernel_module

# (ctx_lens, new lens, nh, nope, rope, v, kv_lora, block_size, dtype, block_m)
CASES = {
    "one-70-H3-no-prefix": ([0], [70], 3, 16, 8, 16, 32, 4, torch.float32, 16),
    "varlen-prefix-H5": ([0, 33, 5], [17, 40, 1], 5, 16, 8, 24, 40, 4, torch.float32, 16),
    "empty-seq-H2-block16": ([10, 0, 7], [0, 50, 35], 2, 16, 16, 16, 32, 16, torch.float32, 32),
    "bf16-varlen-H4": ([20, 0], [45, 66], 4, 32, 16, 32, 64, 16, torch.bfloat16, 32),
}
if ON_GPU:
    CASES["gpu-kimi-48b-8x512-bf16"] = ([0] * 4 + [700] * 4, [512] * 8, 32, 128, 64, 128, 512, 64, torch.bfloat16,
                                        64)
    CASES["gpu-kimi-48b-1x5000-bf16"] = ([3000], [5000], 8, 128, 64, 128, 512, 16, torch.bfloat16, 128)


def prefill_module():
    return kernel_module("mla_prefill", "_mla_prefill_kernel", shares_from=("jit_helpers",))


def make_prefill_batch(ctx_lens, lens, nh, nope, rope, v_dim, kv_lora, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = kv_lora + rope
    need = [-(-(c + n) // block_size) for c, n in zip(ctx_lens, lens)]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, width), float("nan"))
    at = 0
    for i, (c, n) in enumerate(zip(ctx_lens, lens)):
        blocks = perm[at:at + need[i]]
        at += need[i]
        tables[i, :need[i]] = torch.tensor(blocks, dtype=torch.int32)
        flat = cache[blocks].reshape(-1, width)
        flat[: c + n] = torch.randn(c + n, width, generator=g)
        cache[blocks] = flat.view(need[i], block_size, width)
    t = sum(lens)
    q = torch.randn(t, nh, nope + rope, generator=g)
    w_kv_b = torch.randn(nh * (nope + v_dim), kv_lora, generator=g) * kv_lora**-0.5
    cu = torch.tensor([0] + lens).cumsum(0)
    return (q[..., :nope].to(DEVICE, dtype), q[..., nope:].to(DEVICE, dtype), cache.to(DEVICE, dtype),
            w_kv_b.to(DEVICE, dtype), tables.to(DEVICE), torch.tensor(ctx_lens, device=DEVICE), cu.to(DEVICE))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_mla_prefill_matches_eager(case):
    mod = prefill_module()
    ctx_lens, lens, nh, nope, rope, v_dim, kv_lora, bs, dtype, block_m = CASES[case]
    args = make_prefill_batch(ctx_lens, lens, nh, nope, rope, v_dim, kv_lora, bs, dtype)
    scale = (nope + rope) ** -0.5
    out = mod.mla_prefill(*args, scale, block_m=block_m, block_n=16 if not ON_GPU else 64)
    ref = eager.mla_attention(*args, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(f"mla_prefill {case}", out, ref, 2e-2 if dtype != torch.float32 else 1e-5)


def test_mla_prefill_layout_longest_blocks_first():
    mod = prefill_module()
    blocks, kv_starts = mod._layout([5, 0], [0, 3, 40], 16)
    rows = [tuple(blocks[i:i + 4]) for i in range(0, len(blocks), 4)]
    assert kv_starts == [0, 8]
    # (first query row, queries left, first position, key row of position 0)
    assert rows == [(35, 5, 32, 8), (19, 21, 16, 8), (3, 37, 0, 8), (0, 3, 5, 0)]


def test_op_seam_serves_triton_mla_prefill():
    from shard_svc.ops import select_ops

    prefill_module()
    ops = select_ops(DEVICE, "triton")
    assert dict(ops.backends)["mla_prefill"] == "triton"
    assert not getattr(ops.mla_prefill, "graph_safe", False)  # reads the lengths on the host
