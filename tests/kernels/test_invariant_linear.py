"""The batch-invariant GEMM against F.linear, and its point: a row's output is the same bits whether it is computed
among few rows or many (the tail of a split prefill against one pass over the whole prompt).

Tolerances as in test_linear.py: both sides sum exact fp32 products, so they differ by summation order (fp32: 1e-5
relative in norm) and, in bf16, by one rounding each (half a bf16 ulp against float64, twice that between them).
Shapes: M of 1, 37 and 300 rows (several M-blocks), N and K off every block (N=37, K=100), K a multiple of the
K step, 3-D inputs, fp16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.conftest import ON_GPU, assert_close, kernel_module
from tests.kernels.test_linear import make_inputs

CASES = {
    "M1-N37-K100-fp32": (1, 37, 100, torch.float32),
    "M37-N37-K100-fp32": (37, 37, 100, torch.float32),
    "M300-N70-K64-bf16": (300, 70, 64, torch.bfloat16),
    "M37-N1-K96-bf16": (37, 1, 96, torch.bfloat16),
    "M20-N40-K80-fp16": (20, 40, 80, torch.float16),
}
if ON_GPU:
    CASES.update({f"gpu-M{m}-N{n}-K{k}-bf16": (m, n, k, torch.bfloat16)
                  for m in (1, 40, 3752) for n, k in ((12288, 2304), (2304, 4096), (256, 2304))})


def module():
    return kernel_module("invariant_linear", "_invariant_gemm_kernel", shares_from=("jit_helpers", "moe"))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_invariant_linear_matches_f_linear(case):
    m, n, k, dtype = CASES[case]
    x, w = make_inputs(m, n, k, dtype)
    y = module().invariant_linear(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    exact = x.double() @ w.double().t()
    if dtype == torch.float32:
        assert_close(f"invariant linear {case}", y, exact, 1e-5)
        return
    half_ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert_close(f"invariant linear {case} vs float64", y, exact, half_ulp)
    assert_close(f"invariant linear {case} vs F.linear", y, F.linear(x, w), 2 * half_ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_how_many_rows_share_the_product(dtype):
    mod = module()
    x, w = make_inputs(300, 70, 100, dtype, seed=1)
    whole = mod.invariant_linear(x, w)
    for tail in (1, 5, 37, 299):  # the tail alone, as a restored prefix's pass computes it
        assert torch.equal(mod.invariant_linear(x[-tail:], w), whole[-tail:]), tail
    assert torch.equal(mod.invariant_linear(x[100:140], w), whole[100:140])  # rows off the M-block grid


def test_3d_inputs_empty_rows_and_named_errors():
    mod = module()
    x, w = make_inputs(6, 8, 32, torch.float32)
    assert torch.equal(mod.invariant_linear(x.reshape(2, 3, 32), w), mod.invariant_linear(x, w).reshape(2, 3, 8))
    assert mod.invariant_linear(x[:0], w).shape == (0, 8)
    with pytest.raises(mod.TritonKernelError, match=r"linear: weight \(8, 32\) does not match x \(6, 16\)"):
        mod.invariant_linear(x[:, :16], w)
    with pytest.raises(mod.TritonKernelError, match=r"linear: weight \(8, 32\) torch.bfloat16 .*dtype"):
        mod.invariant_linear(x, w.bfloat16())


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; on a GPU run the benchmark itself")
def test_the_benchmarks_pieces_run_on_a_tiny_model():
    """bench/invariant_linear.py: a pass's linears from the model, timed both ways, the tail rows checked."""
    from bench import invariant_linear as bench
    from bench.linear_micro import wall_timer
    from shard_svc.config import ModelConfig
    from tests.engine.conftest import linear_config

    module()
    shapes = bench.pass_linears(ModelConfig.from_dict(linear_config()))
    assert shapes and all(calls >= 1 for _, _, calls in shapes)
    result = {"passes": [bench.time_pass(shapes, m, torch.float32, torch.device("cpu"), wall_timer)
                         for m in (8, 64)]}
    assert all(s["invariant_tail_bitwise"] for s in result["passes"][1]["shapes"])
    assert result["passes"][0]["shapes"][0]["invariant_tail_bitwise"] is None  # fewer rows than the tail
    assert "64" in bench.table(result)
