"""Triton RMSNorm kernels against the eager ops."""

from __future__ import annotations

import math

import pytest
import torch

from shard_svc.ops import norm
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close

# (shape, x dtype, weight dtype)
CASES = {
    "T7-H3-K16-fp32": ((7, 3, 16), torch.float32, torch.float32),
    "T5-H2-K24-bf16": ((5, 2, 24), torch.bfloat16, torch.bfloat16),
    "T33-N128-bf16-x-fp32-weight": ((33, 128), torch.bfloat16, torch.float32),
}
if ON_GPU:
    CASES["gpu-T4096-H32-K128-bf16"] = ((4096, 32, 128), torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_gated_rms_norm_matches_eager(case):
    from shard_svc.ops.triton.norm import gated_rms_norm

    shape, dtype, wdtype = CASES[case]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    # the gate arrives as a view of a [T, H*K] projection
    gate = torch.randn(shape[0], math.prod(shape[1:]), generator=g).to(DEVICE, dtype).view(shape)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, wdtype)
    out = gated_rms_norm(x, weight, gate, 1e-5)
    ref = norm.gated_rms_norm(x, weight, gate, 1e-5)
    assert out.dtype == ref.dtype
    assert_close("gated_rms_norm", out, ref, 1e-2 if dtype != torch.float32 else 1e-6)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_rms_norm_matches_eager(case):
    from shard_svc.ops.triton.norm import rms_norm

    shape, dtype, wdtype = CASES[case]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, wdtype)
    out = rms_norm(x, weight, 1e-5)
    ref = norm.rms_norm(x, weight, 1e-5)
    assert out.dtype == ref.dtype
    assert_close("rms_norm", out, ref, 1e-2 if dtype != torch.float32 else 1e-6)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_add_rms_norm_matches_eager_and_its_sum_is_the_unfused_add(case):
    from shard_svc.ops.triton.norm import add_rms_norm

    shape, dtype, wdtype = CASES[case]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g).to(DEVICE, dtype)
    # the residual stream as a row view of a wider buffer: row strides differ from x's
    wide = torch.randn(shape[0], 2 * math.prod(shape[1:]), generator=g).to(DEVICE, dtype)
    residual = wide[:, :math.prod(shape[1:])].view(shape)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, wdtype)
    normed, h = add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_h = norm.add_rms_norm(x, residual, weight, 1e-5)
    assert h.dtype == ref_h.dtype and normed.dtype == ref_normed.dtype
    # the residual stream must not drift from the unfused model's: the sum is rounded exactly as `residual + x`
    assert torch.equal(h, ref_h), f"sum differs in {(h != ref_h).sum().item()} of {h.numel()} elements"
    assert_close("add_rms_norm", normed, ref_normed, 1e-2 if dtype != torch.float32 else 1e-6)
    assert torch.equal(normed, add_rms_norm(torch.zeros_like(x), h, weight, 1e-5)[0]), \
        "normed output is not the norm of the written sum"


def test_add_rms_norm_refuses_mismatched_inputs():
    from shard_svc.ops.triton.common import TritonKernelError
    from shard_svc.ops.triton.norm import add_rms_norm

    x = torch.randn(3, 16, device=DEVICE)
    weight = torch.ones(16, device=DEVICE)
    with pytest.raises(TritonKernelError, match=r"residual \(3, 8\) must match x \(3, 16\)"):
        add_rms_norm(x, torch.randn(3, 8, device=DEVICE), torch.ones(16, device=DEVICE), 1e-5)
    with pytest.raises(TritonKernelError, match="residual"):
        add_rms_norm(x, torch.randn(3, 16, device=DEVICE, dtype=torch.bfloat16), weight, 1e-5)


def test_op_seam_serves_triton():
    from shard_svc.ops import select_ops

    ops = select_ops(DEVICE, "triton")
    served = dict(ops.backends)
    for name in ("kda_prefill", "kda_decode", "short_conv", "gated_rms_norm", "rms_norm", "add_rms_norm"):
        assert served[name] == "triton", f"{name} is served by {served[name]}"
