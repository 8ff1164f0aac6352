"""The training op backend computes the served model: logits of the project's model run with `training_ops` equal
the eager engine's prompt logits (float64), for both families and every layer kind; MXFP4 rounding equals the
checkpoint's quantise + dequantise; gradients reach every trained parameter."""

from __future__ import annotations

import pytest
import torch

from shard_svc.checkpoint.mxfp4 import E2M1_MAGNITUDES, dequantize_mxfp4, quantize_mxfp4
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops
from tests.engine.conftest import k3_config, linear_config, random_model
from training.mxfp4 import e2m1_grid, fake_quantize_mxfp4, mxfp4_round
from training.ops import chunked_kda, training_context, training_ops

F64 = torch.float64
CONFIGS = {"linear": linear_config(), "k3-13": k3_config(13)}  # 13 layers: two AttnRes blocks, MLA at 4, 8, 12, 13


def engine_logits(raw: dict, prompts: torch.Tensor) -> torch.Tensor:
    cfg, model = random_model(raw, seed=0, dtype=F64)
    engine = Engine(cfg, model, select_ops(torch.device("cpu"), "eager"), torch.device("cpu"),
                    EngineConfig(num_state_slots=len(prompts), num_kv_blocks=64, kv_block_size=16,
                                 prefill_token_budget=4096))
    seqs = [engine.add_request(f"r{i}", p.tolist(), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                               keep_prompt_logits=True) for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return torch.stack([torch.cat(s.prompt_logits) for s in seqs])


@torch.no_grad()
def training_logits(raw: dict, prompts: torch.Tensor, chunk: int) -> torch.Tensor:
    cfg, model = random_model(raw, seed=0, dtype=F64)
    ops = training_ops(*prompts.shape, chunk=chunk)
    hidden = model(prompts.flatten(), training_context(ops, torch.device("cpu")))
    return model.compute_logits(hidden, ops).view(*prompts.shape, -1)


@pytest.mark.parametrize("name", CONFIGS)
def test_training_forward_equals_the_eager_engine(name):
    prompts = torch.randint(0, 255, (3, 48), generator=torch.Generator().manual_seed(1))
    ref = engine_logits(CONFIGS[name], prompts)
    got = training_logits(CONFIGS[name], prompts, chunk=16)
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < 1e-10, f"{name}: training logits differ from the engine's by {err:.2e} of the largest"


def test_chunk_size_does_not_change_kda():
    gen = torch.Generator().manual_seed(0)
    b, length, h, k = 2, 64, 2, 8
    q, kk = (torch.nn.functional.normalize(torch.randn(b, length, h, k, generator=gen, dtype=F64), dim=-1)
             for _ in range(2))
    v = torch.randn(b, length, h, k, generator=gen, dtype=F64)
    g = -torch.rand(b, length, h, k, generator=gen, dtype=F64)
    beta = torch.rand(b, length, h, generator=gen, dtype=F64)
    outs = [chunked_kda(q, kk, v, g, beta, c) for c in (8, 32, 64)]
    assert torch.allclose(outs[0], outs[1], atol=1e-12) and torch.allclose(outs[0], outs[2], atol=1e-12)


def test_the_device_built_e2m1_grid_is_the_checkpoints():
    assert e2m1_grid(torch.device("cpu")).tolist() == list(E2M1_MAGNITUDES)


def test_mxfp4_round_equals_quantize_then_dequantize():
    w = torch.randn(3, 48, 64, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 1, 64)
    ref = torch.stack([dequantize_mxfp4(*quantize_mxfp4(m), torch.float32) for m in w])
    assert torch.equal(mxfp4_round(w), ref)
    p = w.clone().requires_grad_(True)
    fake_quantize_mxfp4(p).sum().backward()
    assert torch.equal(p.grad, torch.ones_like(w)), "straight-through: the gradient passes unchanged"


# K3 with MXFP4-sized experts (widths multiples of 32), so the straight-through rounding is on the path too.
@pytest.mark.parametrize("raw", [linear_config(),
                                 k3_config(13, routed_expert_hidden_size=32, moe_intermediate_size=32)],
                         ids=["linear", "k3-13-mxfp4"])
def test_gradients_reach_every_parameter(raw):
    cfg, model = random_model(raw, seed=0)
    trained = [p for n, p in model.named_parameters() if not n.endswith("e_score_correction_bias")]
    for p in trained:
        p.requires_grad_(True)
    prompts = torch.randint(0, 255, (2, 32), generator=torch.Generator().manual_seed(3))
    ops = training_ops(2, 32, chunk=16, mxfp4_experts=cfg.model_type == "kimi_k3")
    logits = model.compute_logits(model(prompts.flatten(), training_context(ops, torch.device("cpu"))), ops)
    torch.nn.functional.cross_entropy(logits[:-1], prompts.flatten()[1:]).backward()
    names = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    # The first layer's pre-mixer AttnRes has no block summary to mix yet: the model never reads it.
    unread = ["model.layers.0.self_attention_res.norm.weight", "model.layers.0.self_attention_res.proj.weight"]
    assert names == (unread if cfg.attn_res_block_size else []), f"no gradient reached {names}"
