"""Triton sigmoid top-k router against the eager router: the same experts in the same order, the same weights.

Random scores are far from ties, so the chosen experts must be equal; expert counts that are not powers of two,
a bias that changes the choice (weights stay unbiased), renormalisation on and off, decode-sized and longer batches.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from shard_svc.ops.moe import eager
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close

# (T, D, E, k, renormalize, scaling, dtype)
CASES = {
    "T1-D40-E6-k2-renorm": (1, 40, 6, 2, True, 2.446, torch.float32),
    "T9-D64-E33-k4-no-renorm": (9, 64, 33, 4, False, 1.0, torch.float32),
    "T300-D48-E8-k3-long": (300, 48, 8, 3, True, 1.0, torch.float32),
    "T5-D64-E16-k8-bf16": (5, 64, 16, 8, True, 2.446, torch.bfloat16),
}
if ON_GPU:
    CASES.update({f"gpu-T{t}-kimi-linear-bf16": (t, 2304, 256, 8, True, 2.446, torch.bfloat16) for t in (1, 256, 4096)})
    CASES["gpu-T64-k3-bf16"] = (64, 7168, 896, 16, True, 1.0, torch.bfloat16)


def route_module():
    mod = importlib.import_module("shard_svc.ops.triton.moe_route")
    if not ON_GPU and type(mod._router_topk_kernel).__name__ != "InterpretedFunction":
        mod = importlib.reload(mod)
    return mod


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_moe_route_matches_eager(case):
    mod = route_module()
    t, d, e, k, renorm, scaling, dtype = CASES[case]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    gate = (torch.randn(e, d, generator=g) * d**-0.5).to(DEVICE, dtype)
    bias = (torch.randn(e, generator=g) * 0.5).to(DEVICE)  # large enough to change which experts win
    weights, ids = mod.moe_route(x, gate, bias, k, renorm, scaling)
    ref_w, ref_ids = eager.moe_route(x, gate, bias, k, renorm, scaling)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), ref_ids.cpu()), "chosen experts differ"
    assert_close(f"moe_route {case}", weights, ref_w, 1e-5)
    unbiased = eager.moe_route(x, gate, torch.zeros_like(bias), k, renorm, scaling)[1]
    if case == "T300-D48-E8-k3-long":
        assert not torch.equal(unbiased.cpu(), ref_ids.cpu()), "the bias must change some choice in this test"


def test_op_seam_serves_triton_router():
    from shard_svc.ops import select_ops

    route_module()
    ops = select_ops(DEVICE, "triton")
    assert dict(ops.backends)["moe_route"] == "triton"
    assert getattr(ops.moe_route, "graph_safe", False)
