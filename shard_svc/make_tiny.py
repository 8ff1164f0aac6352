"""`kimiserve make-tiny`: a random checkpoint in the PUBLISHED on-disk format at tiny widths, plus a tokenizer.

kimi_linear: one `model.safetensors`; kimi_k3: `text_config` nesting, `language_model.` names, MXFP4 routed experts
and four shards behind `model.safetensors.index.json`, so every loader path runs in tests. Weights are random but
well scaled (normal / sqrt(fan_in), norms near 1, non-zero router biases and AttnRes pseudo-queries) so that a
forward pass is numerically sane and different tokens come out. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from kimiserve.tokenizer_files.tiny import write_tiny_tokenizer
from shard_svc.checkpoint.mxfp4 import quantize_mxfp4
from shard_svc.checkpoint.names import TensorSpec, expected_tensors
from shard_svc.checkpoint.writer import write_shards
from shard_svc.config import ModelConfig
from shard_svc.errors import ConfigError

log = logging.getLogger(__name__)

VOCAB = 1024  # padded beyond the 768-id tiny tokenizer, as real checkpoints pad theirs
BOS, IM_END, PAD = 512, 514, 767  # the tiny tokenizer's [BOS], <|im_end|>, [PAD]


def mla_layers(num_layers: int) -> list[int]:
    """1-based MLA layers: every fourth plus the last (both published topologies follow this rule)."""
    return sorted({i for i in range(4, num_layers + 1, 4)} | {num_layers})


def _common(layers: int) -> dict[str, Any]:
    mla = mla_layers(layers)
    return {
        "vocab_size": VOCAB, "num_hidden_layers": layers, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "bos_token_id": BOS, "eos_token_id": IM_END, "pad_token_id": PAD, "tie_word_embeddings": False,
        "model_max_length": 1 << 20, "mla_use_nope": True, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "num_experts": 8, "num_experts_per_token": 2,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "intermediate_size": 96, "moe_intermediate_size": 32,
        "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                               "full_attn_layers": mla,
                               "kda_layers": [i for i in range(1, layers + 1) if i not in mla]},
    }


def kimi_linear_config(layers: int) -> dict[str, Any]:
    return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **_common(layers),
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
            "hidden_act": "silu", "num_shared_experts": 1, "routed_scaling_factor": 2.446}


def kimi_k3_config(layers: int) -> dict[str, Any]:
    text = {**_common(layers), "model_type": "kimi_k3_text", "hidden_size": 48, "num_attention_heads": 4,
            "q_lora_rank": 32, "mla_use_output_gate": True, "hidden_act": "situ", "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0, "num_shared_experts": 2, "routed_scaling_factor": 1.0,
            "routed_expert_hidden_size": 64, "latent_moe_use_norm": True, "attn_res_block_size": 12}
    text["linear_attn_config"].update(use_full_rank_gate=True, gate_lower_bound=-5.0)
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "torch_dtype": "bfloat16",
            "tie_word_embeddings": False, "text_config": text, "quantization_config": _mxfp4_quantization_config()}


def _mxfp4_quantization_config() -> dict[str, Any]:
    """compressed-tensors MXFP4 on the routed experts only; `ignore` lists every other Linear."""
    weights = {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True}
    ignore = ["lm_head", "re:.*self_attn\\..*", "re:.*\\.mlp\\..*", "re:.*shared_experts\\..*",
              "re:.*block_sparse_moe\\.gate$", "re:.*routed_expert_(down|up)_proj$", "re:.*_res_proj$"]
    return {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}}, "ignore": ignore}


# family -> (config.json builder, default layer count, shard files)
FAMILIES: dict[str, tuple[Callable[[int], dict[str, Any]], int, int]] = {
    "kimi_linear": (kimi_linear_config, 4, 1),
    "kimi_k3": (kimi_k3_config, 93, 4),
}


def write_tiny_checkpoint(family: str, out: Path, seed: int = 0, layers: int | None = None) -> Path:
    """config.json + safetensors weights only (no tokenizer) into the empty or new directory `out`."""
    if family not in FAMILIES:
        raise ConfigError(f"unknown family {family!r} (known: {sorted(FAMILIES)})")
    build, default_layers, shards = FAMILIES[family]
    layers = default_layers if layers is None else layers
    if layers < 1:
        raise ConfigError(f"--layers must be at least 1, got {layers}")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; refusing to mix a new checkpoint with old files")
    out.mkdir(parents=True, exist_ok=True)
    raw = build(layers)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    cfg = ModelConfig.from_dict(raw, source=str(out / "config.json"))
    gen = torch.Generator().manual_seed(seed)
    write_shards(random_tensors(expected_tensors(cfg), cfg, gen), out, shards)
    log.info("wrote tiny %s checkpoint (%d layers, seed %d) to %s", family, layers, seed, out)
    return out


def make_tiny(family: str, out: Path, seed: int = 0, layers: int | None = None) -> Path:
    """A tiny random checkpoint plus the tiny tokenizer (768 ids, specials from 512) in `out`."""
    write_tiny_checkpoint(family, out, seed, layers)
    vocab = write_tiny_tokenizer(out, seed)
    if vocab > VOCAB:
        raise ConfigError(f"tiny tokenizer has {vocab} ids but the tiny model's vocab_size is {VOCAB}")
    return Path(out)


def random_tensors(specs: dict[str, TensorSpec], cfg: ModelConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A value for every expected tensor in its published dtype; MXFP4 experts are quantised from random floats."""
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if spec.role == "mxfp4_scale":
            continue  # written together with its weight_packed
        if spec.role == "mxfp4_packed":
            out, half = spec.shape
            w = torch.randn(out, 2 * half, generator=gen) * (2 * half) ** -0.5
            tensors[name], tensors[name.replace(".weight_packed", ".weight_scale")] = quantize_mxfp4(w)
        else:
            tensors[name] = _random_value(name, spec, cfg, gen).to(spec.dtypes[0])
    return tensors


def _random_value(name: str, spec: TensorSpec, cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    shape, heads = spec.shape, cfg.kda.num_heads
    if spec.role in ("a_log", "a_log_padded"):
        a_log = torch.empty(heads).uniform_(1.0, 16.0, generator=gen).log()
        return torch.cat([a_log, torch.zeros(shape[0] - heads)]) if spec.role == "a_log_padded" else a_log.view(shape)
    if name.endswith(".dt_bias"):
        dt = torch.empty(shape).uniform_(1e-3, 1e-1, generator=gen)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus: softplus(dt_bias) = dt
    if name.endswith(".e_score_correction_bias"):
        return torch.randn(shape, generator=gen) * 0.1
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    fan_in = int(torch.tensor(shape[1:]).prod())
    return torch.randn(shape, generator=gen) * fan_in**-0.5


def add_make_tiny_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES), help="model family to write")
    parser.add_argument("--out", required=True, type=Path, help="new or empty output directory")
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    parser.add_argument("--layers", type=int, default=None,
                        help="number of layers (default: kimi_linear 4, kimi_k3 93); MLA every 4th and the last")


def run_make_tiny(args: argparse.Namespace) -> int:
    path = make_tiny(args.family, args.out, seed=args.seed, layers=args.layers)
    log.info("tiny %s checkpoint ready at %s", args.family, path)
    return 0
