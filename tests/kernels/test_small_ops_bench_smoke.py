"""bench/small_ops.py's add_rms_norm and glu sections (H200 benchmark) run end to end on the CPU: the Triton
interpreter, each graph replay replaced by plain calls, at tiny width."""

from __future__ import annotations

import pytest
import torch

from bench import small_ops as bench
from tests.kernels.conftest import ON_GPU
from tests.kernels.test_glu import glu_module


@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; on a GPU run the benchmark itself")
def test_add_norm_and_glu_sections_run_on_cpu(monkeypatch):
    glu_module()
    calls = []
    monkeypatch.setattr(bench, "graph_us", lambda fns: calls.append(len(fns)) or [f() for f in fns] and 2.0)
    monkeypatch.setattr(bench, "D", 64)
    monkeypatch.setattr(bench, "NORM_T", [1, 300])
    monkeypatch.setattr(bench, "GLU_WIDTHS", (40,))
    norms = bench.add_norm_rows(torch.device("cpu"), 1.0)
    glus = bench.glu_rows(torch.device("cpu"), 1.0)
    assert [r["T"] for r in norms] == [1, 300] and all(r["sum_equal"] and r["err_normed_vs_eager"] < 1e-2
                                                        for r in norms)
    assert all(r["equal_frac"] > 0.99 and r["speedup_vs_eager"] == 1.0 for r in glus)
    # decode rows replay a whole step's calls; prefill rows a few
    assert calls == [bench.NORMS_PER_STEP] * 3 + [4] * 3 + [bench.GLUS_PER_STEP] * 2 + [4] * 2
    res = {"gpu": "cpu", "torch": torch.__version__, "triton": "interp", "copy_TBps": 1.0, "short_conv": [],
           "moe_route": [], "add_rms_norm": norms, "glu": glus}
    text = bench.table(res)
    assert "add_rms_norm D=64" in text and "I=40 T=300" in text
