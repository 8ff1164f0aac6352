"""The Triton backend inside a tiny model, with decode steps through the graph runner's padded buffers (run eagerly:
no capture on the CPU): the MLA decode and MoE kernels meet the model's real views and strides, padding rows
included, and the engine's logits and greedy tokens match the eager backend."""

from __future__ import annotations

import pytest
import torch

from shard_svc.engine.cuda_graphs import CudaGraphRunner, unsafe_decode_ops
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.ops import select_ops
from tests.engine.conftest import linear_config, random_model
from tests.engine.test_cuda_graphs import run
from tests.kernels.conftest import DEVICE, ON_GPU
from tests.kernels.test_linear import linear_module
from tests.kernels.test_mla_decode import mla_module
from tests.kernels.test_moe_experts import moe_module


def generate(raw: dict, ops, graphs: bool) -> list:
    """The engine's prompts (tests/engine/test_cuda_graphs.py: decode batches of 3, 2 and 1 rows) on a tiny random
    model with these ops; graphs: decode through the graph runner's padded buffers (captured only on a GPU)."""
    cfg, model = random_model(raw, seed=0)
    engine = Engine(cfg, model.to(DEVICE), ops, DEVICE, EngineConfig(num_state_slots=4, num_kv_blocks=64,
                                                                     kv_block_size=4, prefill_token_budget=1000))
    if graphs:
        runner = CudaGraphRunner(engine.runner, (1, 2, 4), max_blocks_per_seq=16, capture=ON_GPU)
        runner.capture()
        engine.runner.graphs = runner
    return run(engine)


@pytest.mark.slow
def test_triton_backend_with_decode_graph_buffers_matches_eager():
    moe_module(), mla_module(), linear_module()
    triton_ops = select_ops(DEVICE, "triton")
    assert unsafe_decode_ops(triton_ops) == [], "every decode op of the Triton backend must be graph-safe"
    eager = generate(linear_config(), select_ops(DEVICE, "eager"), graphs=False)
    triton = generate(linear_config(), triton_ops, graphs=True)
    for a, b in zip(eager, triton, strict=True):
        assert a.output == b.output
        la, lb = torch.cat(a.step_logits), torch.cat(b.step_logits)
        err = float((la - lb).abs().max() / la.abs().max())
        assert err <= (3e-3 if ON_GPU else 1e-3), f"step logits differ by {err:.2e} of the largest"  # GPU: TF32


@pytest.mark.slow
def test_triton_backend_with_prefill_graphs_matches_its_eager_passes():
    """Small prefill passes through the prefill graphs (captured on a GPU: the attention breaks between replays; the
    padded buffers run eagerly on the CPU) against the same Triton ops passed op by op: the Triton KDA, conv and MoE
    kernels meet the padding sequence and the empty entries."""
    from shard_svc.engine.prefill_graphs import PrefillGraphRunner
    from tests.engine.test_prefill_graphs import PROMPTS

    moe_module(), mla_module(), linear_module()
    ops = select_ops(DEVICE, "triton")
    assert getattr(ops.kda_prefill, "graph_safe", False), "the Triton kda_prefill must be graph-safe"

    def engine():
        cfg, model = random_model(linear_config(), seed=0)
        return Engine(cfg, model.to(DEVICE), ops, DEVICE, EngineConfig(num_state_slots=len(PROMPTS) + 1,
                                                                       num_kv_blocks=96, kv_block_size=4,
                                                                       prefill_token_budget=24))

    plain = run(engine(), prompts=PROMPTS)
    graphed = engine()
    decode = CudaGraphRunner(graphed.runner, (1, 2, 4), max_blocks_per_seq=16, capture=ON_GPU)
    decode.capture()
    graphed.runner.graphs = decode
    prefill = PrefillGraphRunner(graphed.runner, (16, 32), decode.width, decode.pad_slot, decode.pad_block,
                                 capture=ON_GPU)
    prefill.capture()
    graphed.runner.prefill_graphs = prefill
    seqs = run(graphed, prompts=PROMPTS)
    assert prefill.replays > 0
    for a, b in zip(plain, seqs, strict=True):
        assert a.output == b.output
        la, lb = torch.cat(a.prompt_logits), torch.cat(b.prompt_logits)
        err = float((la - lb).abs().max() / la.abs().max())
        assert err <= 1e-5, f"prompt logits differ by {err:.2e} of the largest"  # GPU: BLAS by shape
