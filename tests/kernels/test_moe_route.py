"""Triton sigmoid top-k router against the eager router: the same experts in the same order, the same weights.

Random scores are far from ties, so the chosen experts must be equal; expert counts that are not powers of two,
a bias that changes the choice (weights stay unbiased), renormalisation on and off, decode-sized and longer batches.
Small batches split the hidden dimension over several programs (partial logits the top-k kernel adds up) and use a
top-k tile of the batch's own height: T = 1, 2, 3, 16, 17 with a hidden size that splits, D not a multiple of the
K block, and explicit splits; exact ties go to the lower expert id, as torch.topk.
"""

from __future__ import annotations


import pytest
import torch

from shard_svc.ops.moe import eager
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, kernel_module

# (T, D, E, k, renormalize, scaling, dtype)
CASES = {
    "T1-D40-E6-k2-renorm": (1, 40, 6, 2, True, 2.446, torch.float32),
    "T9-D64-E33-k4-no-renorm": (9, 64, 33, 4, False, 1.0, torch.float32),
    "T300-D48-E8-k3-long": (300, 48, 8, 3, True, 1.0, torch.float32),
    "T5-D64-E16-k8-bf16": (5, 64, 16, 8, True, 2.446, torch.bfloat16),
    **{f"T{t}-D1000-E40-k6-split": (t, 1000, 40, 6, True, 2.446, torch.float32) for t in (1, 2, 3, 16, 17)},
    **{f"T{t}-D1024-E24-k8-split-bf16": (t, 1024, 24, 8, True, 1.0, torch.bfloat16) for t in (1, 3, 17)},
    "T40-D768-E72-k4-split": (40, 768, 72, 4, False, 1.0, torch.float32),
}
if ON_GPU:
    CASES.update({f"gpu-T{t}-kimi-linear-bf16": (t, 2304, 256, 8, True, 2.446, torch.bfloat16)
                  for t in (1, 2, 3, 16, 17, 64, 256, 4096)})
    CASES["gpu-T64-k3-bf16"] = (64, 7168, 896, 16, True, 1.0, torch.bfloat16)


def route_module():
    return kernel_module("moe_route", "_router_topk_kernel")


def inputs(t, d, e, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    gate = (torch.randn(e, d, generator=g) * d**-0.5).to(DEVICE, dtype)
    bias = (torch.randn(e, generator=g) * 0.5).to(DEVICE)  # large enough to change which experts win
    return x, gate, bias


def assert_matches_eager(name, x, gate, bias, k, renorm, scaling, **kw):
    weights, ids = route_module().moe_route(x, gate, bias, k, renorm, scaling, **kw)
    ref_w, ref_ids = eager.moe_route(x, gate, bias, k, renorm, scaling)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids.cpu()), f"{name}: chosen experts differ"
    assert_close(f"moe_route {name}", weights, ref_w, 1e-5)
    return ref_ids


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_moe_route_matches_eager(case):
    t, d, e, k, renorm, scaling, dtype = CASES[case]
    x, gate, bias = inputs(t, d, e, dtype)
    ref_ids = assert_matches_eager(case, x, gate, bias, k, renorm, scaling)
    unbiased = eager.moe_route(x, gate, torch.zeros_like(bias), k, renorm, scaling)[1]
    if case == "T300-D48-E8-k3-long":
        assert not torch.equal(unbiased.cpu(), ref_ids.cpu()), "the bias must change some choice in this test"


@pytest.mark.parametrize("split_k", [1, 2, 3, 7, 100])
@pytest.mark.parametrize("t", [1, 17, 300])
def test_moe_route_explicit_split(t, split_k):
    x, gate, bias = inputs(t, 1000, 40, torch.float32, seed=1)
    assert_matches_eager(f"T{t} split_k={split_k}", x, gate, bias, 6, True, 2.446, split_k=split_k)


@pytest.mark.parametrize("t", [1, 3, 17])
def test_moe_route_ties_go_to_the_lower_expert(t):
    """Experts 5, 21 and 37 have the same gate row and bias (bit-equal scores, each at column 5 of its 16-expert
    block) and a bias that makes them win: they are chosen in id order; their weights are equal."""
    x, gate, bias = inputs(t, 1000, 40, torch.float32, seed=2)
    gate[21] = gate[37] = gate[5]
    bias[[5, 21, 37]] = 10.0
    weights, ids = route_module().moe_route(x, gate, bias, 4, True, 1.0)
    assert ids[:, :3].cpu().tolist() == [[5, 21, 37]] * t
    assert torch.equal(weights[:, 0], weights[:, 1]) and torch.equal(weights[:, 0], weights[:, 2])


@pytest.mark.parametrize("rows", [1, 2, 8, 64])
def test_moe_route_any_topk_rows(rows):
    """Tokens per top-k program only tile the batch: every choice agrees with eager (17 tokens: a partial tile)."""
    x, gate, bias = inputs(17, 200, 40, torch.float32, seed=3)
    assert_matches_eager(f"topk_rows={rows}", x, gate, bias, 6, True, 2.446, topk_rows=rows)


def test_moe_route_rejects_bad_split():
    from shard_svc.ops.triton.common import TritonKernelError

    x, gate, bias = inputs(1, 64, 8, torch.float32)
    with pytest.raises(TritonKernelError, match="split_k 0"):
        route_module().moe_route(x, gate, bias, 2, True, 1.0, split_k=0)
    with pytest.raises(TritonKernelError, match="topk_rows 3"):
        route_module().moe_route(x, gate, bias, 2, True, 1.0, topk_rows=3)


def test_op_seam_serves_triton_router():
    from shard_svc.ops import select_ops

    route_module()
    ops = select_ops(DEVICE, "triton")
    assert dict(ops.backends)["moe_route"] == "triton"
    assert getattr(ops.moe_route, "graph_safe", False)
