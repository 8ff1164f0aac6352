"""The two trained models: their config.json (published format, both families) and their initial weights.

Sizes keep each checkpoint at about 8 MB in bf16 with the 2,304-id tokenizer (2,048 BPE + 256 Kimi specials):
- `kimi-linear-austen`: kimi_linear, hidden 256, 4 layers (KDA, KDA, KDA, MLA; a dense first MLP, then MoE with 8
  routed experts, top 2, one shared expert);
- `kimi-k3-austen`: kimi_k3 with the full 93-layer topology (MLA at 4, 8, ..., 92 and 93, Block Attention Residuals
  in blocks of 12, latent MoE with MXFP4 routed experts, SiTU-GLU, bounded KDA gate) at hidden 64.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from shard_svc.config import ModelConfig
from shard_svc.make_tiny import mla_layers
from shard_svc.model import KimiForCausalLM
from training.mxfp4 import mxfp4_round

BASE_VOCAB = 2048
VOCAB = BASE_VOCAB + 256  # [BOS] 2048, [EOS] 2049, <|im_end|> 2050, ..., [PAD] 2303
BOS, IM_END, PAD = BASE_VOCAB, BASE_VOCAB + 2, VOCAB - 1


def _layers(n: int) -> dict[str, Any]:
    mla = mla_layers(n)
    return {"full_attn_layers": mla, "kda_layers": [i for i in range(1, n + 1) if i not in mla]}


def _common(n: int) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB, "num_hidden_layers": n, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "bos_token_id": BOS, "eos_token_id": IM_END, "pad_token_id": PAD, "tie_word_embeddings": False,
        "model_max_length": 1 << 20, "mla_use_nope": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "num_experts": 8, "num_experts_per_token": 2,
    }


def kimi_linear_config() -> dict[str, Any]:
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **_common(4),
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
        "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
        "intermediate_size": 384, "moe_intermediate_size": 64, "num_shared_experts": 1, "hidden_act": "silu",
        "routed_scaling_factor": 2.446,
        "linear_attn_config": {"num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4, **_layers(4)},
    }


def kimi_k3_config(layers: int = 93) -> dict[str, Any]:
    text = {
        **_common(layers), "model_type": "kimi_k3_text", "hidden_size": 64, "num_attention_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "mla_use_output_gate": True, "intermediate_size": 128, "moe_intermediate_size": 32, "num_shared_experts": 1,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "routed_scaling_factor": 1.0, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "attn_res_block_size": 12,
        "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
                               "gate_lower_bound": -5.0, **_layers(layers)},
    }
    weights = {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True}
    ignore = ["lm_head", "re:.*self_attn\\..*", "re:.*\\.mlp\\..*", "re:.*shared_experts\\..*",
              "re:.*block_sparse_moe\\.gate$", "re:.*routed_expert_(down|up)_proj$", "re:.*_res_proj$"]
    quant = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
             "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}}, "ignore": ignore}
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "torch_dtype": "bfloat16",
            "tie_word_embeddings": False, "text_config": text, "quantization_config": quant}


# name -> config.json builder
MODELS: dict[str, Callable[[], dict[str, Any]]] = {
    "kimi-linear-austen": kimi_linear_config,
    "kimi-k3-austen": kimi_k3_config,
}

# Projections that write into the residual stream: scaled down with depth so the stream does not grow at init.
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", ".w2", "routed_expert_up_proj.weight")


@torch.no_grad()
def init_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> KimiForCausalLM:
    """The project's model with initial weights (deterministic for a seed, drawn on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype)
    model = model.to_empty(device="cpu")
    depth = min(cfg.num_layers, cfg.attn_res_block_size or cfg.num_layers)  # AttnRes restarts the sum per block
    heads, head_dim = cfg.kda.num_heads, cfg.kda.head_dim
    for name, p in model.named_parameters():
        if name.endswith(".A_log"):
            # Kimi-Linear: decay rate exp(A_log) in [1, 16]; K3's bounded gate: rate 1, the range comes from dt_bias.
            value = (torch.empty(heads).uniform_(1.0, 16.0, generator=gen).log() if cfg.kda.gate_lower_bound is None
                     else torch.zeros(heads))
        elif name.endswith(".dt_bias"):
            # log-uniform in [1e-3, 1e-1]: Kimi-Linear's softplus(dt_bias), K3's sigmoid(dt_bias) (times the -5
            # lower bound: per-token log-decays of -0.005 to -0.5 at init)
            t = torch.empty(heads * head_dim).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            value = t + torch.log(-torch.expm1(-t)) if cfg.kda.gate_lower_bound is None else torch.log(t / (1 - t))
        elif name.endswith(".e_score_correction_bias"):
            value = torch.zeros(p.shape)
        elif name.endswith("_res.proj.weight"):
            value = torch.zeros(p.shape)  # AttnRes pseudo-queries: uniform mixing at init
        elif name.endswith("norm.weight"):
            value = torch.ones(p.shape)
        elif name == "lm_head.weight":
            value = torch.zeros(p.shape)
        elif name.endswith("embed_tokens.weight"):
            value = torch.randn(p.shape, generator=gen)
        elif "conv1d" in name:
            value = torch.empty(p.shape).uniform_(-0.5, 0.5, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
            if name.endswith(_OUTPUT_PROJECTIONS):
                value /= math.sqrt(2 * depth)
        p.copy_(value.to(p.dtype))
    return model.to(device)


@torch.no_grad()
def round_experts_to_mxfp4(model: KimiForCausalLM) -> int:
    """Replace every routed expert weight by its MXFP4-rounded value, the value the written checkpoint holds, so
    that evaluating the model in memory evaluates the served model. Returns how many tensors were rounded."""
    experts = [p for n, p in model.named_parameters() if n.endswith((".experts.w1", ".experts.w2", ".experts.w3"))]
    for p in experts:
        p.copy_(mxfp4_round(p).to(p.dtype))
    return len(experts)
