"""Write a model's parameters as a checkpoint in the published on-disk format: the loader's inverse.

`published_tensors` turns each parameter into the stored tensors the loader's table (names.py) expects, by role:
the published name and dtype, A_log in its stored layout, routed experts one tensor per expert (MXFP4-packed where
the config says so). `write_shards` writes them as one `model.safetensors` or as shards behind an index.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from shard_svc.checkpoint.files import INDEX, SINGLE
from shard_svc.checkpoint.mxfp4 import quantize_mxfp4
from shard_svc.checkpoint.names import tensor_specs
from shard_svc.config import ModelConfig
from shard_svc.model import KimiForCausalLM


def published_tensors(cfg: ModelConfig, model: KimiForCausalLM) -> dict[str, torch.Tensor]:
    """Every tensor the checkpoint of `model` holds, by published name, on the CPU."""
    params = {name: p.detach().cpu() for name, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in tensor_specs(cfg, model).items():
        value = params[spec.param] if spec.expert is None else params[spec.param][spec.expert]
        if spec.role == "mxfp4_scale":
            continue  # written with its weight_packed
        if spec.role == "mxfp4_packed":
            packed, scale = quantize_mxfp4(value)
            tensors[name], tensors[name.replace(".weight_packed", ".weight_scale")] = packed, scale
            continue
        if spec.role == "a_log_padded":
            value = torch.cat([value, value.new_zeros(spec.shape[0] - value.shape[0])])
        tensors[name] = value.reshape(spec.shape).to(spec.dtypes[0]).contiguous()
    return tensors


def write_shards(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """One `model.safetensors`, or `shards` files of about equal size behind an index (in tensor order)."""
    if shards == 1:
        save_file(tensors, str(out / SINGLE), metadata={"format": "pt"})
        return
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(shards)]
    written = 0
    for name, t in tensors.items():
        parts[min(shards - 1, written * shards // total)][name] = t
        written += t.numel() * t.element_size()
    parts = [part for part in parts if part]  # fewer tensors than shards: fewer files
    weight_map = {}
    for i, part in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
