"""The skinny decode GEMM and the Triton `linear` dispatch against F.linear.

Tolerances: both sides multiply the same inputs with fp32 accumulation (products of bf16 inputs are exact in fp32),
so they differ only in summation order, about K * 2^-24 of the sum of |products| at worst (on the H200, K=4096
outputs near zero differ from cuBLAS by more than one ulp of themselves for that reason); for fp32 the test
bound 1e-5 (relative, in norm) covers K up to a few thousand with random signs. bf16 outputs are each rounded once
to bf16: against the exact (float64) product both sides are within half a bf16 ulp (2^-9 relative) per element,
and against each other within one ulp where the two fp32 sums straddle a rounding boundary.
Shapes: M of 1, 3 and 16 rows; N and K off every block size (N=37, K=100), N=1, K split over programs (a second
launch sums the partials) with an uneven last range, and strided x rows.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, kernel_module

# (M, N, K, dtype, config or None for the automatic choice: (block_n, block_k, splits))
CASES = {
    "M1-N37-K100-fp32": (1, 37, 100, torch.float32, None),
    "M3-N37-K100-fp32": (3, 37, 100, torch.float32, None),
    "M16-N37-K100-bf16": (16, 37, 100, torch.bfloat16, None),
    "M1-N1-K64-fp32": (1, 1, 64, torch.float32, None),
    "M3-N1-K100-bf16": (3, 1, 100, torch.bfloat16, None),
    "M1-N40-K96-fp32-two-n-blocks-even-k": (1, 40, 96, torch.float32, (32, 32, 1)),
    "M3-N37-K100-fp32-split3-uneven": (3, 37, 100, torch.float32, (16, 16, 3)),
    "M16-N50-K128-bf16-split4": (16, 50, 128, torch.bfloat16, (16, 32, 4)),
    "M1-N20-K80-fp16": (1, 20, 80, torch.float16, None),
}
if ON_GPU:
    CASES.update({f"gpu-M{m}-N{n}-K{k}-bf16": (m, n, k, torch.bfloat16, None)
                  for m in (1, 4, 16) for n, k in ((12288, 2304), (2304, 4096), (128, 2304), (32, 2304),
                                                   (4096, 128), (163840, 2304))})


def linear_module():
    return kernel_module("linear", "_skinny_kernel", shares_from=("jit_helpers",))


def make_inputs(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE, dtype)
    return x, w


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_skinny_linear_matches_f_linear(case):
    mod = linear_module()
    m, n, k, dtype, cfg = CASES[case]
    x, w = make_inputs(m, n, k, dtype)
    config = mod.SkinnyConfig(*cfg) if cfg else None
    y = mod.skinny_linear(x, w, config)
    assert y.dtype == dtype and y.shape == (m, n)
    exact = x.double() @ w.double().t()
    ref = F.linear(x, w)
    if dtype == torch.float32:
        assert_close(f"linear {case}", y, exact, 1e-5)
        return
    half_ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert_close(f"linear {case} vs float64", y, exact, half_ulp)
    assert_close(f"linear {case} vs F.linear", y, ref, 2 * half_ulp)
    # Per element: one ulp of rounding, plus what a different fp32 summation order can move a sum that cancels
    # (up to K * 2^-24 of the sum of |products| on each side); near-zero outputs of long sums need the second term.
    ulp = y.double().abs().clamp_min(2.0**-60) * 2 * half_ulp
    order = 2 * k * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    assert ((y.double() - ref.double()).abs() <= ulp * 1.01 + order).all(), "an element differs by more than one ulp"


def test_strided_rows_and_split_reduction_are_deterministic():
    mod = linear_module()
    x, w = make_inputs(6, 37, 100, torch.float32, seed=1)
    wide = torch.zeros(3, 160, device=DEVICE)
    wide[:, :100] = x[:3]  # rows 160 apart: a view such as a slice of a packed projection output
    cfg = mod.SkinnyConfig(16, 16, 4)
    a = mod.skinny_linear(wide[:, :100], w, cfg)
    b = mod.skinny_linear(wide[:, :100], w, cfg)
    assert torch.equal(a, b), "the split-K reduction must be deterministic"
    assert_close("strided x", a, x[:3].double() @ w.double().t(), 1e-5)


def test_empty_rows_and_named_errors():
    mod = linear_module()
    x, w = make_inputs(2, 8, 32, torch.float32)
    assert mod.skinny_linear(x[:0], w).shape == (0, 8)
    with pytest.raises(mod.TritonKernelError, match=r"linear: weight \(8, 32\) does not match x \(2, 16\)"):
        mod.skinny_linear(x[:, :16], w)
    with pytest.raises(mod.TritonKernelError, match=r"linear: weight \(8, 32\) torch.bfloat16 .*dtype"):
        mod.skinny_linear(x, w.bfloat16())
    with pytest.raises(mod.TritonKernelError, match=r"x \(17, 32\) has 17 rows; .* at most 16"):
        mod.skinny_linear(torch.zeros(17, 32, device=DEVICE), w)
    with pytest.raises(mod.TritonKernelError, match=r"linear: x \(2, 32\) torch.float64"):
        mod.skinny_linear(x.double(), w.double())
    with pytest.raises(mod.TritonKernelError, match=r"linear: weight \(32, 8\) .*last dim must be contiguous"):
        mod.skinny_linear(torch.zeros(2, 8, device=DEVICE), w.t())


def test_dispatch_by_shape():
    mod = linear_module()
    x, w = make_inputs(20, 24, 32, torch.float32)
    assert mod.uses_skinny(x[:mod.DISPATCH_MAX_M], w) and not mod.uses_skinny(x[:mod.DISPATCH_MAX_M + 1], w)
    assert not mod.uses_skinny(x[:4], w.t().contiguous().t()), "a transposed weight goes to F.linear"
    assert not mod.uses_skinny(x[:4].unsqueeze(0), w), "3-D inputs go to F.linear"
    assert torch.equal(mod.linear(x, w), F.linear(x, w)), "above DISPATCH_MAX_M rows the op is F.linear itself"
    assert_close("dispatch, 16 rows", mod.linear(x[:16], w), x[:16].double() @ w.double().t(), 1e-5)


def test_unbound_streamed_weight_raises_missing_slot():
    """A streamed weight used without a device slot must raise through the Triton dispatch too."""
    from shard_svc.weight_streaming.errors import MissingSlotError
    from shard_svc.weight_streaming.streamer import UnboundWeight

    mod = linear_module()
    w = UnboundWeight.make("model.layers.3.self_attn.q_proj.weight", (8, 32), torch.float32)
    with pytest.raises(MissingSlotError, match=r"model\.layers\.3\.self_attn\.q_proj\.weight"):
        mod.linear(torch.ones(1, 32, device=DEVICE), w)
    with pytest.raises(MissingSlotError, match=r"model\.layers\.3\.self_attn\.q_proj\.weight"):
        mod.skinny_linear(torch.ones(1, 32, device=DEVICE), w)


@pytest.mark.parametrize("elem", [2, 4])
def test_config_for_the_48b_shapes_fills_an_h200(elem):
    """At 132 SMs every Kimi-Linear-48B linear gets at least one program per SM (two where N allows), steps that
    divide K (no K mask) and split ranges that are whole steps."""
    mod = linear_module()
    sms = 132
    shapes = [(12288, 2304), (4096, 2304), (128, 2304), (32, 2304), (4096, 128), (2304, 4096), (6144, 2304),
              (576, 2304), (1024, 2304), (2304, 1024), (9216, 2304), (2304, 9216), (163840, 2304)]
    for n, k in shapes:
        cfg = mod.skinny_config(n, k, elem, sms)
        programs = -(-n // cfg.block_n) * cfg.splits
        assert programs >= min(sms, 2 * -(-n // 16)), f"[{n}, {k}]: {cfg} gives {programs} programs"
        assert k % cfg.block_k == 0, f"[{n}, {k}]: {cfg} needs a K mask"
        assert (cfg.splits > 1) == (-(-n // 16) < sms), f"[{n}, {k}]: split only when N is small ({cfg})"
        per_stage = (cfg.block_n + mod.BLOCK_M) * cfg.block_k * elem
        assert cfg.num_stages * per_stage <= mod.SMEM_PER_PROGRAM or cfg.num_stages == 2


def test_op_seam_serves_triton_linear():
    from shard_svc.ops import select_ops

    linear_module()
    ops = select_ops(DEVICE, "triton")
    assert dict(ops.backends)["linear"] == "triton"
    assert getattr(ops.linear, "graph_safe", False)
    assert dict(select_ops(DEVICE, "eager").backends)["linear"] == "eager"
    assert select_ops(DEVICE, "eager").linear is F.linear
