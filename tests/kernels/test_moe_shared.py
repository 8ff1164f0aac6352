"""The shared expert inside the grouped MoE kernels (`ops/triton/moe_shared.py`) against the eager composition
(`ops/moe/eager.py::with_shared_expert`), its layout, and the dispatch between the fused and composed paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shard_svc.ops import activations
from shard_svc.ops.moe import eager
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, kernel_module
from tests.kernels.test_moe_experts import SITU, make_inputs, moe_module

EAGER_SHARED = eager.with_shared_expert(eager.moe_experts, F.linear, activations.glu)

# (T, Din, I, E, k, activation, dtype)
CASES = {
    "T1-D40-I24-E5-k2-silu": (1, 40, 24, 5, 2, "silu", torch.float32),
    "T3-D64-I48-E7-k4-bf16-silu": (3, 64, 48, 7, 4, "silu", torch.bfloat16),
    "T16-D48-I40-E8-k3-situ": (16, 48, 40, 8, 3, "situ", torch.float32),
    "T11-D80-I24-E5-k2-bf16-situ": (11, 80, 24, 5, 2, "situ", torch.bfloat16),
}
if ON_GPU:
    CASES.update({f"gpu-T{t}-kimi-linear-bf16": (t, 2304, 1024, 256, 8, "silu", torch.bfloat16) for t in (1, 4, 16)})


def shared_module():
    """moe_shared.py over interpreted kernel modules; it has no kernel of its own, so it is reloaded every time (its
    `composed` then binds the interpreted moe, linear and glu)."""
    moe_module()
    kernel_module("glu", "_glu_kernel", shares_from=("jit_helpers",))
    kernel_module("linear", "_skinny_kernel", shares_from=("jit_helpers",))
    return kernel_module("moe_shared", "composed")


def shared_weights(d, inter, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(2 * inter, d, generator=g) * d**-0.5).to(DEVICE, dtype)
    down = (torch.randn(d, inter, generator=g) * inter**-0.5).to(DEVICE, dtype)
    return gate_up, down


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_shared_expert_matches_the_eager_composition(case):
    mod = shared_module()
    t, d, inter, e, k, act, dtype = CASES[case]
    x, weights, ids, w1, w3, w2 = make_inputs(t, d, inter, e, k, dtype, seed=6)
    gate_up, down = shared_weights(d, inter, dtype)
    assert mod.fusable(x, w1, gate_up, down, mod.FUSE_MAX_TOKENS)
    out = mod.moe_experts_shared(x, weights, ids, w1, w3, w2, act, SITU, gate_up, down)
    ref = EAGER_SHARED(x, weights, ids, w1, w3, w2, act, SITU, gate_up, down)
    assert out.dtype == x.dtype
    assert_close(f"moe_experts_shared {case}", out, ref, 1e-2 if dtype != torch.float32 else 1e-5)
    # the shared expert's part is there, and is the shared expert's: without it, or with another, the sum is far off
    routed = eager.moe_experts(x, weights, ids, w1, w3, w2, act, SITU)
    other = EAGER_SHARED(x, weights, ids, w1, w3, w2, act, SITU, *shared_weights(d, inter, dtype, seed=9))
    for name, wrong in (("routed only", routed), ("another shared expert", other)):
        with pytest.raises(AssertionError):
            assert_close(name, out, wrong, 5e-2)


def test_larger_batches_and_wider_shared_experts_compose():
    """Past FUSE_MAX_TOKENS, or with a shared expert wider than a routed one, the op is the composition of the
    Triton ops themselves (bit for bit), which matches eager."""
    mod = shared_module()
    d, inter, e, k = 40, 24, 5, 2
    for t, width in ((mod.FUSE_MAX_TOKENS + 1, inter), (2, 2 * inter)):
        x, weights, ids, w1, w3, w2 = make_inputs(t, d, inter, e, k, torch.float32, seed=t)
        gate_up, down = shared_weights(d, width, torch.float32)
        assert not mod.fusable(x, w1, gate_up, down, mod.FUSE_MAX_TOKENS)
        out = mod.moe_experts_shared(x, weights, ids, w1, w3, w2, "silu", SITU, gate_up, down)
        assert torch.equal(out, mod.composed(x, weights, ids, w1, w3, w2, "silu", SITU, gate_up, down))
        assert_close(f"T={t} width={width}", out, EAGER_SHARED(x, weights, ids, w1, w3, w2, "silu", SITU, gate_up,
                                                                 down), 1e-5)
    # the fused path forced on a larger batch agrees too (several M-blocks of the shared expert's run)
    x, weights, ids, w1, w3, w2 = make_inputs(40, d, inter, e, k, torch.float32, seed=8)
    gate_up, down = shared_weights(d, inter, torch.float32)
    out = mod.moe_experts_shared(x, weights, ids, w1, w3, w2, "situ", SITU, gate_up, down, max_tokens=1 << 20)
    assert_close("forced fused T=40", out, EAGER_SHARED(x, weights, ids, w1, w3, w2, "situ", SITU, gate_up, down),
                 1e-5)


@pytest.mark.parametrize("path", ["one", "grid"])
def test_align_puts_every_tokens_last_choice_in_the_shared_experts_run(path):
    mod = moe_module()
    t, k, e, bm = 37, 3, 6, 16
    g = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    layout = mod.moe_align(ids, e, bm, small_max=1 << 30 if path == "one" else 0, shared=True)
    n = t * (k + 1)
    # pair t * (k + 1) + j: choice j < k is ids[t, j]; choice k is the shared expert, numbered e
    expert_of_pair = torch.cat([ids.cpu(), torch.full((t, 1), e)], dim=1).reshape(-1)
    counts = torch.bincount(expert_of_pair, minlength=e + 1)
    padded = (counts + bm - 1) // bm * bm
    assert int(layout.num_padded.item()) == int(padded.sum())
    sorted_ids, expert_ids = layout.sorted_ids.cpu(), layout.expert_ids.cpu()
    start = 0
    for ex in range(e + 1):
        run = sorted_ids[start:start + int(padded[ex])]
        assert sorted(run[:int(counts[ex])].tolist()) == (expert_of_pair == ex).nonzero().flatten().tolist()
        assert (run[int(counts[ex]):] == n).all()
        assert (expert_ids[start // bm:(start + int(padded[ex])) // bm] == ex).all()
        start += int(padded[ex])
    assert counts[e] == t


def test_refuses_shared_weights_in_another_dtype():
    from shard_svc.ops.triton.common import TritonKernelError

    mod = shared_module()
    x, weights, ids, w1, w3, w2 = make_inputs(2, 40, 24, 5, 2, torch.float32)
    gate_up, down = shared_weights(40, 24, torch.bfloat16)
    with pytest.raises(TritonKernelError, match="shared_gate_up"):
        mod.moe_experts_shared(x, weights, ids, w1, w3, w2, "silu", SITU, gate_up, down)


def test_op_seam_serves_the_fused_op_and_eager_leaves_it_to_the_model():
    from shard_svc.ops import select_ops

    shared_module()
    triton_ops = select_ops(DEVICE, "triton")
    assert dict(triton_ops.backends)["moe_experts_shared"] == "triton"
    assert getattr(triton_ops.moe_experts_shared, "graph_safe", False)
    eager_ops = select_ops(torch.device("cpu"), "eager")
    assert eager_ops.moe_experts_shared is None
    assert dict(eager_ops.backends)["moe_experts_shared"] == "composed in the model"
