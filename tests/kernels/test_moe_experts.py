"""Triton fused MoE (align + grouped GEMMs + combine) against the eager expert loop.

Odd widths (K tails), expert counts and top-k that are not powers of two, SwiGLU and SiTU, decode-sized and
larger batches, both align paths (one program / histogram + scan + place), and the layout invariants themselves.
"""

from __future__ import annotations


import pytest
import torch

from shard_svc.ops.moe import eager
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, kernel_module

SITU = (4.0, 25.0)

# (T, Din, I, E, k, activation, dtype, align path)
CASES = {
    "T1-D40-I24-E5-k2-silu-decode": (1, 40, 24, 5, 2, "silu", torch.float32, "one"),
    "T7-D64-I32-E6-k3-silu": (7, 64, 32, 6, 3, "silu", torch.float32, "one"),
    "T67-D48-I40-E8-k3-situ": (67, 48, 40, 8, 3, "situ", torch.float32, "one"),
    "T67-D48-I40-E8-k3-silu-grid-align": (67, 48, 40, 8, 3, "silu", torch.float32, "grid"),
    "T150-D32-I16-E3-k2-silu-big-blocks": (150, 32, 16, 3, 2, "silu", torch.float32, "grid"),
    "T9-D64-I48-E7-k4-bf16-silu": (9, 64, 48, 7, 4, "silu", torch.bfloat16, "one"),
    "T33-D80-I24-E5-k2-bf16-situ": (33, 80, 24, 5, 2, "situ", torch.bfloat16, "grid"),
}
if ON_GPU:
    CASES.update({
        f"gpu-T{t}-kimi-linear-bf16": (t, 2304, 1024, 256, 8, "silu", torch.bfloat16, path)
        for t, path in ((1, "one"), (64, "one"), (256, "one"), (3000, "grid"))
    })
    CASES["gpu-T300-k3-latent-situ-bf16"] = (300, 3584, 3072, 64, 16, "situ", torch.bfloat16, "grid")


def moe_module():
    return kernel_module("moe", "_moe_gate_up_kernel", shares_from=("jit_helpers",))


def make_inputs(t, d, inter, e, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    # distinct experts per token, as top-k gives them; some experts get no token at all
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)] or [torch.zeros(k).long()])[:t]
    ids = ids.to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    w1 = (torch.randn(e, inter, d, generator=g) * d**-0.5).to(DEVICE, dtype)
    w3 = (torch.randn(e, inter, d, generator=g) * d**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, d, inter, generator=g) * inter**-0.5).to(DEVICE, dtype)
    return x, weights, ids, w1, w3, w2


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_moe_experts_matches_eager(case):
    mod = moe_module()
    t, d, inter, e, k, act, dtype, path = CASES[case]
    x, weights, ids, w1, w3, w2 = make_inputs(t, d, inter, e, k, dtype)
    small = 1 << 30 if path == "one" else 0
    out = mod.moe_experts(x, weights, ids, w1, w3, w2, act, SITU, small_align_max=small)
    ref = eager.moe_experts(x, weights, ids, w1, w3, w2, act, SITU)
    assert out.dtype == x.dtype
    assert_close(f"moe_experts {case}", out, ref, 1e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_moe_experts_any_block_m(block_m):
    """The M-block only changes the padding: results agree for every block size."""
    mod = moe_module()
    x, weights, ids, w1, w3, w2 = make_inputs(21, 40, 24, 4, 2, torch.float32, seed=3)
    out = mod.moe_experts(x, weights, ids, w1, w3, w2, "silu", SITU, block_m=block_m)
    assert_close(f"BM={block_m}", out, eager.moe_experts(x, weights, ids, w1, w3, w2, "silu", SITU), 1e-5)


def test_moe_experts_in_passes():
    """A long batch runs in passes of chunk_pairs pairs (here 5 tokens of top-2 per pass, the last one short)."""
    mod = moe_module()
    x, weights, ids, w1, w3, w2 = make_inputs(23, 32, 16, 5, 2, torch.float32, seed=4)
    out = mod.moe_experts(x, weights, ids, w1, w3, w2, "situ", SITU, chunk_pairs=10)
    assert_close("passes", out, eager.moe_experts(x, weights, ids, w1, w3, w2, "situ", SITU), 1e-5)


def test_moe_experts_k1_rows_and_int32_ids():
    """How expert parallelism calls it: one chosen expert per row, int32 ids, a routing weight per row."""
    mod = moe_module()
    x, weights, ids, w1, w3, w2 = make_inputs(13, 32, 16, 6, 1, torch.float32, seed=5)
    out = mod.moe_experts(x, weights, ids.int(), w1, w3, w2, "silu", SITU)
    assert_close("k=1", out, eager.moe_experts(x, weights, ids, w1, w3, w2, "silu", SITU), 1e-5)


def test_moe_experts_empty_batch():
    mod = moe_module()
    x, weights, ids, w1, w3, w2 = make_inputs(0, 16, 16, 3, 2, torch.float32)
    assert mod.moe_experts(x, weights, ids, w1, w3, w2, "silu", SITU).shape == (0, 16)


def test_moe_experts_refuses_bad_inputs():
    mod = moe_module()
    x, weights, ids, w1, w3, w2 = make_inputs(3, 16, 16, 3, 2, torch.float32)
    with pytest.raises(mod.TritonKernelError, match="activation"):
        mod.moe_experts(x, weights, ids, w1, w3, w2, "gelu", SITU)
    with pytest.raises(mod.TritonKernelError, match="w2"):
        mod.moe_experts(x, weights, ids, w1, w3, w2.transpose(1, 2), "silu", SITU)
    with pytest.raises(mod.TritonKernelError, match="weights"):
        mod.moe_experts(x, weights.double(), ids, w1, w3, w2, "silu", SITU)


# (T, k, E, BM)
ALIGN_CASES = {"T1-k2-E5-BM16": (1, 2, 5, 16), "T40-k3-E7-BM16": (40, 3, 7, 16),
               "T100-k4-E6-BM32": (100, 4, 6, 32), "T300-k2-E3-BM64": (300, 2, 3, 64),
               "T9-k1-E33-BM16-empty-experts": (9, 1, 33, 16)}


@pytest.mark.parametrize("path", ["one", "grid"])
@pytest.mark.parametrize("case", list(ALIGN_CASES), ids=list(ALIGN_CASES))
def test_moe_align_layout(case, path):
    mod = moe_module()
    t, k, e, bm = ALIGN_CASES[case]
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)] or [torch.zeros(k).long()])[:t]
    ids = ids.to(DEVICE)
    layout = mod.moe_align(ids, e, bm, small_max=1 << 30 if path == "one" else 0)
    flat = ids.reshape(-1).cpu()
    n = flat.numel()
    sorted_ids, expert_ids = layout.sorted_ids.cpu(), layout.expert_ids.cpu()
    counts = torch.bincount(flat, minlength=e)
    padded = (counts + bm - 1) // bm * bm
    total = int(padded.sum())
    assert int(layout.num_padded.item()) == total
    assert sorted_ids.numel() == layout.max_blocks * bm and total <= sorted_ids.numel()
    start = 0
    for ex in range(e):
        run = sorted_ids[start:start + int(padded[ex])]
        real, pad = run[: int(counts[ex])], run[int(counts[ex]):]
        assert sorted(real.tolist()) == (flat == ex).nonzero().flatten().tolist(), f"expert {ex} run"
        assert (pad == n).all(), f"expert {ex}: padding rows must hold the sentinel {n}"
        blocks = expert_ids[start // bm:(start + int(padded[ex])) // bm]
        assert (blocks == ex).all(), f"expert {ex}: blocks {blocks.tolist()}"
        start += int(padded[ex])
    assert ((expert_ids[: total // bm] >= 0) & (expert_ids[: total // bm] < e)).all()


def test_op_seam_serves_triton_moe():
    from shard_svc.ops import select_ops

    moe_module()
    ops = select_ops(DEVICE, "triton")
    assert dict(ops.backends)["moe_experts"] == "triton"
    assert getattr(ops.moe_experts, "graph_safe", False)
