"""Triton gated activation against the eager op (`ops/activations.py::glu`)."""

from __future__ import annotations

import pytest
import torch

from shard_svc.ops import activations
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, kernel_module

BETAS = (3.0, 8.0)  # K3's SiTU betas are of this size; small enough that both tanh arms bend
# (rows, intermediate, dtype); gate and up are the column halves of one [rows, 2I] product, as the model passes them
CASES = {
    "T1-I24-fp32": (1, 24, torch.float32),
    "T5-I40-bf16": (5, 40, torch.bfloat16),
    "T33-I1100-bf16": (33, 1100, torch.bfloat16),  # I over one column block, not a power of two
}
if ON_GPU:
    CASES["gpu-T4096-I1024-bf16"] = (4096, 1024, torch.bfloat16)


def glu_module():
    return kernel_module("glu", "_glu_kernel", shares_from=("jit_helpers",))


@pytest.mark.parametrize("activation", ["silu", "situ"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_glu_matches_eager(case, activation):
    rows, inter, dtype = CASES[case]
    g = torch.Generator().manual_seed(3)
    joint = (3 * torch.randn(rows, 2 * inter, generator=g)).to(DEVICE, dtype)
    gate, up = joint.split(inter, dim=-1)
    out = glu_module().glu(gate, up, activation, BETAS)
    ref = activations.glu(gate, up, activation, BETAS)
    assert out.dtype == ref.dtype and out.is_contiguous()
    assert_close(f"glu {activation}", out, ref, 1e-2 if dtype != torch.float32 else 1e-5)
    if dtype == torch.bfloat16:
        # silu(gate) is rounded where eager rounds it: all but the rare exp-ulp tie agree bit for bit
        same = (out == ref).float().mean().item()
        assert same >= 0.99, f"only {same:.1%} of elements equal the eager op's"


def test_glu_takes_leading_dims_and_refuses_mismatches():
    from shard_svc.ops.triton.common import TritonKernelError

    glu = glu_module().glu
    x = torch.randn(2, 3, 16, device=DEVICE)
    assert torch.equal(glu(x, x, "silu", BETAS), glu(x.reshape(6, 16), x.reshape(6, 16), "silu", BETAS).view(2, 3, 16))
    with pytest.raises(TritonKernelError, match=r"up \(6, 8\) must match gate \(6, 16\)"):
        glu(x.reshape(6, 16), torch.randn(6, 8, device=DEVICE), "silu", BETAS)
    with pytest.raises(TritonKernelError, match="activation 'gelu'"):
        glu(x, x, "gelu", BETAS)
