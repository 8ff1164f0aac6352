"""The Triton `linear` op inside a tiny model: every other op eager, so a difference is the linear's alone. Decode
steps run through the graph runner's padded buffers (eagerly on the CPU), so the skinny kernel sees the model's real
decode shapes (1, 2 and 4 padded rows, the packed weight groups, their column views as strided inputs, lm_head);
prefill passes of more than `DISPATCH_MAX_M` tokens take the F.linear side of the dispatch. Greedy tokens must
equal the all-eager run's, logits agree to fp32 rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from shard_svc.ops import select_ops
from tests.engine.conftest import k3_config, linear_config
from tests.kernels.conftest import DEVICE, ON_GPU
from tests.kernels.test_linear import linear_module
from tests.kernels.test_mla_moe_in_model import generate as run_prompts

def generate(raw: dict, triton_linear: bool, paths: list[tuple[bool, bool]] | None = None):
    """paths: filled with (`uses_skinny`, x contiguous) of every linear call (triton_linear only). On the GPU the
    decode graphs are captured, so the ops around the linear are the (graph-safe) Triton ones, F.linear the
    reference's linear."""
    ops = dataclasses.replace(select_ops(DEVICE, "triton" if ON_GPU else "eager"), linear=F.linear)
    if triton_linear:
        mod = linear_module()

        def recorded(x, w):
            paths.append((mod.uses_skinny(x, w), x.is_contiguous()))
            return mod.linear(x, w)

        ops = dataclasses.replace(ops, linear=recorded)
    return run_prompts(raw, ops, graphs=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["linear", "k3-6"])
def test_triton_linear_in_model_matches_eager(family):
    raw = linear_config() if family == "linear" else k3_config(6)  # K3: q-LoRA, output gates, latent MoE
    eager = generate(raw, triton_linear=False)
    paths: list[tuple[bool, bool]] = []
    triton = generate(raw, triton_linear=True, paths=paths)
    skinny = [s for s, _ in paths]
    assert any(skinny) and not all(skinny), "decode must run the skinny kernel and long prefill F.linear"
    assert (True, False) in paths, "decode must feed the skinny kernel a column view of a packed group's product"
    for a, b in zip(eager, triton, strict=True):
        assert a.output == b.output
        for la, lb in ((torch.cat(a.prompt_logits), torch.cat(b.prompt_logits)),
                       (torch.cat(a.step_logits), torch.cat(b.step_logits))):
            err = float((la - lb).abs().max() / la.abs().max())
            assert err <= 1e-5, f"logits differ by {err:.2e} of the largest"
