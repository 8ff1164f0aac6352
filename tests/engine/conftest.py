"""Tiny random models built in memory (no checkpoint, no loader) for engine invariants."""

from __future__ import annotations

import math

import pytest
import torch

from shard_svc.config import ModelConfig
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.model import KimiForCausalLM
from shard_svc.ops import select_ops


def linear_config(**overrides) -> dict:
    cfg = {
        "model_type": "kimi_linear", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 2, "kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 8, "rms_norm_eps": 1e-5, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_experts": 6, "num_experts_per_token": 2, "num_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.446, "moe_renormalize": True,
        "eos_token_id": 255, "torch_dtype": "float32",
        "linear_attn_config": {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
    }
    cfg.update(overrides)
    return cfg


def k3_config(layers: int = 26, **overrides) -> dict:
    full = [i for i in range(4, layers + 1, 4)] + ([layers] if layers % 4 else [])
    text = linear_config(num_hidden_layers=layers, q_lora_rank=12, mla_use_output_gate=True, hidden_act="situ",
                         routed_expert_hidden_size=24, latent_moe_use_norm=True, routed_scaling_factor=1.0,
                         num_shared_experts=2, attn_res_block_size=12)
    text["linear_attn_config"] = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4,
                                  "full_attn_layers": full, "use_full_rank_gate": True, "gate_lower_bound": -5.0}
    text.update(overrides)
    text.pop("model_type")
    return {"model_type": "kimi_k3", "text_config": text}


def random_model(raw: dict, seed: int = 0, dtype=torch.float32) -> tuple[ModelConfig, KimiForCausalLM]:
    cfg = ModelConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype)
    model = model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.data = torch.log(torch.rand(p.shape, generator=gen) * 15 + 1)
        elif name.endswith("dt_bias") or name.endswith("e_score_correction_bias"):
            p.data = torch.randn(p.shape, generator=gen) * 0.1
        elif "norm" in name.split(".")[-2] and p.dim() == 1:
            p.data = (1 + 0.1 * torch.randn(p.shape, generator=gen)).to(p.dtype)
        else:
            fan_in = p.shape[-1]
            p.data = (torch.randn(p.shape, generator=gen) / math.sqrt(fan_in)).to(p.dtype)
    return cfg, model.eval()


def make_engine(raw: dict, seed: int = 0, dtype=torch.float32, grammars=None, **engine_kw) -> Engine:
    cfg, model = random_model(raw, seed, dtype)
    return Engine(cfg, model, select_ops(torch.device("cpu"), "eager"), torch.device("cpu"),
                  EngineConfig(**engine_kw), grammars=grammars)


@pytest.fixture
def linear_engine() -> Engine:
    return make_engine(linear_config())
