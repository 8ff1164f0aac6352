"""The Triton backend inside a tiny model, with decode steps through the graph runner's padded buffers (run eagerly:
no capture on the CPU): the MLA decode and MoE kernels meet the model's real views and strides, padding rows
included, and the engine's logits and greedy tokens match the eager backend."""

from __future__ import annotations

import pytest
import torch

from shard_svc.engine.cuda_graphs import CudaGraphRunner, unsafe_decode_ops
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops
from tests.engine.conftest import linear_config, random_model
from tests.kernels.conftest import DEVICE, ON_GPU
from tests.kernels.test_linear import linear_module
from tests.kernels.test_mla_decode import mla_module
from tests.kernels.test_moe_experts import moe_module

PROMPTS = [(23, 4), (5, 2), (40, 5)]  # (prompt length, tokens): decode batches of 3, 2 and 1 rows


def generate(backend: str, graphs: bool):
    cfg, model = random_model(linear_config(), seed=0)
    model = model.to(DEVICE)
    ops = select_ops(DEVICE, backend)
    engine = Engine(cfg, model, ops, DEVICE, EngineConfig(num_state_slots=4, num_kv_blocks=64, kv_block_size=4,
                                                          prefill_token_budget=1000))
    if graphs:
        assert unsafe_decode_ops(ops) == [], "every decode op of the Triton backend must be graph-safe"
        runner = CudaGraphRunner(engine.runner, (1, 2, 4), max_blocks_per_seq=16, capture=ON_GPU)
        runner.capture()
        engine.runner.graphs = runner
    gen = torch.Generator().manual_seed(0)
    seqs = [engine.add_request(f"r{i}", torch.randint(0, 255, (n,), generator=gen).tolist(),
                               SamplingParams(max_tokens=m, ignore_eos=True), keep_prompt_logits=True)
            for i, (n, m) in enumerate(PROMPTS)]
    while engine.has_work():
        engine.step()
    return seqs


@pytest.mark.slow
def test_triton_backend_with_decode_graph_buffers_matches_eager():
    moe_module(), mla_module(), linear_module()
    eager = generate("eager", graphs=False)
    triton = generate("triton", graphs=True)
    for a, b in zip(eager, triton):
        assert a.output == b.output
        la, lb = torch.cat(a.step_logits), torch.cat(b.step_logits)
        err = float((la - lb).abs().max() / la.abs().max())
        assert err <= 1e-3, f"step logits differ by {err:.2e} of the largest"
