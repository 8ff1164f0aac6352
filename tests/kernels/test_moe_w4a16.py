"""Triton W4A16 MoE (packed MXFP4 experts) against the eager MoE over the dequantised weights.

Random experts are quantised with `quantize_mxfp4`, so both sides use exactly the same weight values; scale bytes
span small and large exponents (including byte 0, a subnormal multiplier), K tails off the tile grid, SwiGLU and
SiTU, both align paths.
"""

from __future__ import annotations


import pytest
import torch

from shard_svc.checkpoint.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from shard_svc.ops.moe import eager
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, kernel_module
from tests.kernels.test_moe_experts import SITU

# (T, Din, I, E, k, activation, dtype, align path)
CASES = {
    "T1-D64-I32-E5-k2-silu-decode": (1, 64, 32, 5, 2, "silu", torch.float32, "one"),
    "T19-D96-I64-E6-k3-situ-k-tail": (19, 96, 64, 6, 3, "situ", torch.float32, "one"),
    "T40-D64-I96-E3-k2-silu-grid": (40, 64, 96, 3, 2, "silu", torch.float32, "grid"),
    "T11-D64-I32-E4-k2-bf16-situ": (11, 64, 32, 4, 2, "situ", torch.bfloat16, "one"),
}
if ON_GPU:
    CASES["gpu-T1-k3-latent-bf16"] = (1, 3584, 3072, 64, 16, "situ", torch.bfloat16, "one")
    CASES["gpu-T200-k3-latent-bf16"] = (200, 3584, 3072, 64, 16, "situ", torch.bfloat16, "grid")


def w4_module():
    return kernel_module("moe_w4a16", "_moe_gate_up_w4_kernel", shares_from=("jit_helpers", "moe"))


def quantised(e, out, width, g, spread=4.0):
    """MXFP4 experts [E, out, width] with per-row magnitudes over several octaves; plus one row of tiny values so
    a scale byte of 0 (2^-127) appears."""
    w = torch.randn(e, out, width, generator=g) * torch.exp2(torch.randint(-int(spread), int(spread), (e, out, 1),
                                                                         generator=g).float()) * width**-0.5
    w[0, 0] = 1e-39
    packed, scale = zip(*(quantize_mxfp4(w[i]) for i in range(e)))
    return torch.stack(packed), torch.stack(scale)


def make_inputs(t, d, inter, e, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    packed = {"w1": quantised(e, inter, d, g), "w3": quantised(e, inter, d, g), "w2": quantised(e, d, inter, g)}
    packed = {name: (q.to(DEVICE), s.to(DEVICE)) for name, (q, s) in packed.items()}
    dense = {name: torch.stack([dequantize_mxfp4(q[i], s[i], dtype) for i in range(e)])
             for name, (q, s) in packed.items()}
    return x, weights, ids, packed, dense


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_moe_w4a16_matches_eager_on_dequantised_weights(case):
    mod = w4_module()
    t, d, inter, e, k, act, dtype, path = CASES[case]
    x, weights, ids, packed, dense = make_inputs(t, d, inter, e, k, dtype)
    assert (packed["w1"][1] == 0).any(), "the test must cover a scale byte of 0"
    out = mod.moe_experts_w4a16(x, weights, ids, packed, act, SITU, small_align_max=1 << 30 if path == "one" else 0)
    ref = eager.moe_experts(x, weights, ids, dense["w1"], dense["w3"], dense["w2"], act, SITU)
    assert out.dtype == x.dtype
    assert_close(f"moe_experts_w4a16 {case}", out, ref, 1e-2 if dtype != torch.float32 else 1e-5)


def test_moe_w4a16_refuses_unpacked_or_misshapen_weights():
    mod = w4_module()
    x, weights, ids, packed, dense = make_inputs(3, 64, 32, 3, 2, torch.float32)
    with pytest.raises(mod.TritonKernelError, match="uint8"):
        mod.moe_experts_w4a16(x, weights, ids, {**packed, "w2": (dense["w2"], packed["w2"][1])}, "silu", SITU)
    q, s = packed["w1"]
    with pytest.raises(mod.TritonKernelError, match="w1 packed"):
        mod.moe_experts_w4a16(x, weights, ids, {**packed, "w1": (q[:, :, :16], s)}, "silu", SITU)
    with pytest.raises(mod.TritonKernelError, match="multiples of the MXFP4 group"):
        mod.moe_experts_w4a16(x[:, :48], weights, ids, packed, "silu", SITU)
