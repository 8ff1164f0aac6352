"""The table of tensors a checkpoint must hold: published name -> shape, accepted dtypes, model parameter, role.

Built from the model's own `named_parameters()`, so the loader, make-tiny and the tests share one source of
truth. The model mirrors the published names except for the rules below (docs/models.md#stored-vs-model-layout):
- K3 text tensors live under `language_model.` (`cfg.tensor_prefix`);
- AttnRes modules `*_res.{norm,proj}` are stored flat as `*_res_{norm,proj}`;
- routed experts are stacked in the model ([E, out, in]) and stored one tensor per expert, optionally MXFP4;
- KDA `A_log` is [H] in the model and stored [1, 1, H, 1] (Kimi-Linear) or [head_dim] zero-padded (K3);
- dense-layer MLPs may be stored under `mlp.` or `block_sparse_moe.` (transformers' save_pretrained).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Literal

import torch

from shard_svc.checkpoint.mxfp4 import GROUP
from shard_svc.config import ModelConfig
from shard_svc.errors import ConfigError, UnsupportedModelError, UnsupportedQuantizationError
from shard_svc.model import KimiForCausalLM

Role = Literal["weight", "a_log", "a_log_padded", "mxfp4_packed", "mxfp4_scale"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Published in fp32 whatever the declared dtype; the declared dtype is accepted too.
_FP32_NATIVE = (".A_log", ".dt_bias", ".e_score_correction_bias")
# Published in the declared dtype, but transformers keeps the router in fp32 (`_keep_in_fp32_modules_strict`), so
# its save_pretrained writes fp32 router weights: accept both.
_FP32_TOLERATED = (".block_sparse_moe.gate.weight",)

_ATTN_RES = re.compile(r"(self_attention_res|mlp_res|output_attn_res)\.(norm|proj)\.weight$")
_EXPERTS = re.compile(r"\.experts\.(w1|w2|w3)$")
_DENSE_MLP = re.compile(r"\.mlp\.((?:gate|up|down)_proj\.weight)$")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the checkpoint must hold."""

    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]  # accepted; the first is the one the published format writes
    param: str  # the model parameter it fills
    role: Role = "weight"  # how its values become the parameter's (see loader)
    expert: int | None = None  # slot in a stacked routed-expert parameter
    aliases: tuple[str, ...] = ()  # other accepted names; exactly one of name + aliases may be present


def declared_dtype(cfg: ModelConfig) -> torch.dtype:
    if cfg.torch_dtype not in DTYPES:
        raise ConfigError(f"torch_dtype {cfg.torch_dtype!r} is not supported (known: {sorted(DTYPES)})")
    return DTYPES[cfg.torch_dtype]


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint for `cfg` must hold, keyed by its published name."""
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, declared_dtype(cfg))
    return tensor_specs(cfg, model)


def tensor_specs(cfg: ModelConfig, model: KimiForCausalLM) -> dict[str, TensorSpec]:
    """The expected-tensor table for an already built (meta) model."""
    specs: dict[str, TensorSpec] = {}
    for param, p in model.named_parameters():
        for name, spec in _specs_for(cfg, param, tuple(p.shape)):
            if name in specs:
                raise AssertionError(f"two model parameters map to checkpoint tensor {name}")
            specs[name] = spec
    return specs


def _specs_for(cfg: ModelConfig, param: str, shape: tuple[int, ...]) -> Iterator[tuple[str, TensorSpec]]:
    name = cfg.tensor_prefix + _ATTN_RES.sub(r"\1_\2.weight", param)
    dtypes = _dtypes(cfg, param)
    if _EXPERTS.search(param):
        yield from _expert_specs(cfg, name, param, shape, dtypes)
    elif param.endswith(".A_log"):
        yield name, _A_LOG_LAYOUTS[cfg.model_type](cfg, param, shape, dtypes)
    else:
        alias = _DENSE_MLP.sub(r".block_sparse_moe.\1", name)
        yield name, TensorSpec(shape, dtypes, param, aliases=(alias,) if alias != name else ())


def _dtypes(cfg: ModelConfig, param: str) -> tuple[torch.dtype, ...]:
    declared = declared_dtype(cfg)
    if param.endswith(_FP32_NATIVE):
        return tuple(dict.fromkeys((torch.float32, declared)))
    if param.endswith(_FP32_TOLERATED):
        return tuple(dict.fromkeys((declared, torch.float32)))
    return (declared,)


def _expert_specs(cfg: ModelConfig, name: str, param: str, shape: tuple[int, ...],
                  dtypes: tuple[torch.dtype, ...]) -> Iterator[tuple[str, TensorSpec]]:
    """Stacked [E, out, in] -> `experts.{e}.w*.weight`, or its MXFP4 `weight_packed` + `weight_scale` pair."""
    num_experts, out, width = shape
    head, which = name.rsplit(".", 1)  # "...experts", "w1"
    if cfg.quantization == "mxfp4" and width % GROUP:
        raise UnsupportedQuantizationError(f"{param}: MXFP4 needs input width {width} to be a multiple of {GROUP}")
    for e in range(num_experts):
        stem = f"{head}.{e}.{which}"
        if cfg.quantization == "mxfp4":
            yield f"{stem}.weight_packed", TensorSpec((out, width // 2), (torch.uint8,), param, "mxfp4_packed", e)
            yield f"{stem}.weight_scale", TensorSpec((out, width // GROUP), (torch.uint8,), param, "mxfp4_scale", e)
        else:
            yield f"{stem}.weight", TensorSpec((out, width), dtypes, param, "weight", e)


def _a_log_4d(cfg: ModelConfig, param: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> TensorSpec:
    """Kimi-Linear stores A_log [1, 1, H, 1]."""
    return TensorSpec((1, 1, shape[0], 1), dtypes, param, "a_log")


def _a_log_padded(cfg: ModelConfig, param: str, shape: tuple[int, ...],
                  dtypes: tuple[torch.dtype, ...]) -> TensorSpec:
    """K3 stores A_log 1-D with head_dim entries: the first H are the heads', the rest must be zero."""
    if shape[0] > cfg.kda.head_dim:
        raise UnsupportedModelError(f"{param}: K3 stores A_log as [head_dim={cfg.kda.head_dim}], which cannot hold "
                                    f"{shape[0]} heads")
    return TensorSpec((cfg.kda.head_dim,), dtypes, param, "a_log_padded")


_A_LOG_LAYOUTS: dict[str, Callable[..., TensorSpec]] = {"kimi_linear": _a_log_4d, "kimi_k3": _a_log_padded}
