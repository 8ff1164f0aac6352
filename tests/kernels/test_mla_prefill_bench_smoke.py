"""bench/mla_prefill_long.py (the H200 benchmark of the long-context MLA prefill) runs end to end on the CPU at a
tiny shape: the Triton kernel in the interpreter, `math_attend` standing in for cuDNN, a wall-clock timer."""

from __future__ import annotations

import functools
import time

import pytest

from bench import mla_prefill_long as bench
from shard_svc.ops.mla.long_context import math_attend
from tests.kernels.conftest import ON_GPU
from tests.kernels.test_mla_prefill import prefill_module


def wall_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; on a GPU run the benchmark itself")
def test_bench_runs_on_cpu_and_its_columns_agree():
    mod = prefill_module()
    prefill = functools.partial(mod.mla_prefill, block_m=16, block_n=16, workspace_tokens=24,
                                long_attend=math_attend, long_pairs=300)
    shape = bench.Shape(heads=2, nope=16, rope=8, v=16, kv_lora=32, page=4)
    result = bench.run(shape, [0, 40], 16, [4, 16], [0, 20], prefill, math_attend, wall_ms, "cpu",
                       new_shapes=((9, 9, True), (5, 21, False)), layouts=[dict(block_m=16, block_n=32, num_stages=3)],
                       layout_context=30)
    assert [(r["context"], r["chunk"]) for r in result["rows"]] == [(0, 16), (40, 16)]
    for r in result["rows"]:  # no context stays in the kernel, 16 x 40 goes to the library: both checked
        assert r["served_vs_eager"] < 1e-2 and r["served_vs_triton"] < 1e-2
        assert r["served_ms"] > 0 and r["cudnn_attention_ms"] > 0
    assert [(r["context"], r["chunk"]) for r in result["crossover"]] == [(0, 4), (0, 16), (20, 4), (20, 16)]
    assert all(r["library_vs_kernel"] < 1e-2 for r in result["crossover"])
    assert set(result["prompt_attention_s"]) == {"served", "triton", "cudnn_attention", "matmul_ceiling"}
    text = bench.table(result)
    assert [(r["queries"], r["keys"], r["causal"]) for r in result["new_shape"]] == [(9, 9, True), (5, 21, False)]
    assert all("err_vs_math" in r for r in result["new_shape"])  # small shapes carry the check against math
    assert [r["layout"] for r in result["layouts"]] == ["default", dict(block_m=16, block_n=32, num_stages=3)]
    assert result["layouts"][1]["err_vs_default"] < 1e-2  # another tiling of the same attention
    assert "1,048,576-token prompt" in text and len(text.splitlines()) == 2 + 2 + 1 + 2 + 1 + 2 + 1 + 4 + 1


def test_whole_prompt_estimate_is_the_sum_over_passes_of_the_fitted_line():
    rows = [{"context": 0, "t": 10.0}, {"context": 100, "t": 30.0}]  # 10 ms + 0.2 ms per context token
    # passes at contexts 0, 50, 100, 150: 10 + 20 + 30 + 40 ms, times 7 layers
    assert bench.whole_prompt_s(rows, "t", 50, prompt=200) == pytest.approx(7 * 0.1)
