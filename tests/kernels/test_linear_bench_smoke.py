"""bench/linear_micro.py (the H200 benchmark) is import-safe, derives the 48B decode linears from the model, and its
pieces run end to end on the CPU (Triton interpreter, wall-clock timer) at tiny width."""

from __future__ import annotations

import pytest
import torch

from bench import linear_micro as bench
from bench.configs import KIMI_LINEAR_48B
from shard_svc.config import ModelConfig
from tests.engine.conftest import linear_config
from tests.kernels.conftest import ON_GPU
from tests.kernels.test_linear import linear_module


def test_48b_decode_linears_from_the_model():
    uses = {u.role: (u.n, u.k, u.count) for u in bench.decode_linears(ModelConfig.from_dict(KIMI_LINEAR_48B))}
    # Kimi-Linear-48B: 20 KDA layers (32 heads x 128), 7 MLA layers (32 heads x 192, latent 512 + rope 64),
    # 26 MoE layers with one 1024-wide shared expert, one dense layer (9216); the runner packs weights that multiply
    # the same input into one product.
    assert uses["kda.q_proj+k_proj+v_proj (packed)"] == (3 * 32 * 128, 2304, 20)
    assert uses["kda.f_a_proj+g_a_proj+b_proj (packed)"] == (128 + 128 + 32, 2304, 20)
    assert uses["kda.o_proj"] == (2304, 4096, 20)
    assert uses["mla.q_proj+kv_a_proj_with_mqa (packed)"] == (32 * 192 + 576, 2304, 7)
    assert uses["block_sparse_moe.shared_experts.gate_proj+up_proj (packed)"] == (2 * 1024, 2304, 26)
    assert uses["mlp.gate_proj+up_proj (packed)"] == (2 * 9216, 2304, 1)
    assert uses["mlp.down_proj"] == (2304, 9216, 1) and uses["lm_head"] == (163840, 2304, 1)
    assert not any("kv_b_proj" in r for r in uses)
    # per KDA layer q|k|v, f_a|g_a|b, f_b, g_b, o; per MLA layer q|kv_a, o; per MoE layer gate|up, down; dense 2; head
    assert sum(c for _, _, c in uses.values()) == 20 * 5 + 7 * 2 + 26 * 2 + 2 + 1


@pytest.mark.slow  # every benchmark piece in the interpreter: out of `make test-fast`
@pytest.mark.skipif(ON_GPU, reason="the CPU smoke run; on a GPU run the benchmark itself")
def test_bench_pieces_run_on_cpu(monkeypatch):
    linear_module()
    monkeypatch.setattr(bench, "SWEEP_BLOCK_N", (16, 32))
    monkeypatch.setattr(bench, "SWEEP_SPLITS", (1, 2))
    cfg = ModelConfig.from_dict(linear_config())
    result = bench.run(cfg, [1, 3], torch.float32, torch.device("cpu"), bench.wall_timer, graph=False, sweep=True)
    shapes = {(u.n, u.k) for u in bench.decode_linears(cfg)}
    assert len(result["shapes"]) == 2 * len(shapes) == len(result["sweeps"])
    assert all(r["max_rel_err"] < 1e-5 and r["ours"]["us"] > 0 for r in result["shapes"])
    step = result["steps"][0]
    assert step["calls"] == sum(u["count"] for u in result["uses"]) and step["sum_ours_ms"] > 0
    text = bench.table(result)
    assert "decode step M=3" in text and "sweep M=1" in text and "lm_head x1" in text


def test_help_and_argument_checks(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0 and "--sweep" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench.main(["--m", "1,32"])
    assert e.value.code == 2
