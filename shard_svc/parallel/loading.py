"""Build a rank's slice of the model: slice the modules, then load only that slice from the checkpoint.

Each rank loads only its slice (never the full model and then slices): K3 is 2.8T parameters, far more than one
GPU or one host's memory. Every rank validates the whole checkpoint against config.json (headers only, cheap) with
the same validator as one process, then reads: its routed experts only (other ranks' experts are never read); the
rows/columns of sliced tensors through safetensors' memory-mapped slicing (only those bytes are copied); and the
replicated tensors whole. MXFP4 experts are dequantised whole (one expert at a time) before their width is sliced.
`parallelize` also works on a materialised model (tests slice an in-memory random model the same way).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError

from shard_svc.checkpoint import (check_all_filled, check_nothing_on_meta, convert_stored, fill_sources,
                                  load_dtype)
from shard_svc.checkpoint.files import CheckpointFiles
from shard_svc.checkpoint.mxfp4 import dequantize_mxfp4
from shard_svc.checkpoint.names import tensor_specs
from shard_svc.checkpoint.validate import Fill, plan_fills
from shard_svc.config import ModelConfig
from shard_svc.errors import CheckpointFileError, CheckpointMismatch
from shard_svc.model import KimiForCausalLM
from shard_svc.parallel.expert_parallel import shard_experts
from shard_svc.parallel.group import ModelComm
from shard_svc.parallel.plan import ParamShard, ShardPlan, Slice, narrow_all
from shard_svc.parallel.tensor_parallel import shard_attention, shard_dense

log = logging.getLogger(__name__)


def parallelize(model: KimiForCausalLM, comm: ModelComm) -> tuple[torch.nn.Module, ShardPlan]:
    """This rank's slice of `model` (edited in place; the returned root replaces it) and the record of slices."""
    comm.layout.check(model.cfg)
    plan = ShardPlan()
    if comm.layout.world == 1:
        return model, plan
    shard_attention(model, comm, plan)
    shard_experts(model, comm, plan)
    return shard_dense(model, comm, plan), plan


class SlicingFiles(CheckpointFiles):
    """CheckpointFiles that can read part of a tensor (safetensors slicing on the memory map)."""

    def read_slice(self, name: str, slices: tuple[Slice, ...]) -> torch.Tensor:
        if not slices:
            return self.read(name)
        if self.reads[name]:
            raise AssertionError(f"checkpoint tensor {name} read twice")
        self.reads[name] += 1
        info = self.tensors[name]
        index = [slice(None)] * len(info.shape)
        for dim, start, size in slices:
            index[dim] = slice(start, start + size)
        try:
            return self._handles[info.file].get_slice(name)[tuple(index)]
        except (SafetensorError, OSError) as e:
            raise CheckpointFileError(f"{self.dir / info.file}: cannot read {index} of tensor {name}: {e}") from e


def load_sharded_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype | str | None,
                       comm: ModelComm) -> tuple[ModelConfig, torch.nn.Module]:
    """(config, this rank's slice of the model with every local parameter loaded on `device`)."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    dtype = load_dtype(dtype, cfg)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype)
    specs = tensor_specs(cfg, model)  # the full checkpoint's table, before slicing
    model, plan = parallelize(model, comm)
    with SlicingFiles(model_dir, keep_prefix=cfg.tensor_prefix) as files:
        fills = plan_fills(specs, files, cfg)
        params = _materialise_local(model, fills, files, plan, device)
    model.load_state_dict(params, strict=True, assign=True)
    model.requires_grad_(False)
    check_nothing_on_meta(model)
    log.info("loaded model slice", extra={"model": str(model_dir), "rank": comm.layout.rank, "tp": comm.layout.tp,
                                          "ep": comm.layout.ep, "tensors_read": sum(files.reads.values()),
                                          "tensors_in_checkpoint": len(files.tensors), "device": str(device)})
    return cfg, model.eval()


def _materialise_local(model: torch.nn.Module, fills: list[Fill], files: SlicingFiles, plan: ShardPlan,
                       device: torch.device) -> dict[str, torch.Tensor]:
    meta = dict(model.named_parameters())
    out = {name: torch.empty(p.shape, dtype=p.dtype, device=device) for name, p in meta.items()}
    filled: dict[str, set[int | None]] = {name: set() for name in meta}
    for fill in fills:
        full_shape = tuple(meta[fill.param].shape)
        shard = plan.params.get(fill.param, ParamShard(full_shape, ()))
        if fill.expert is None:
            target, slot, slices, shape = out[fill.param], None, shard.slices, shard.full_shape
        else:
            slot = shard.local_expert(fill.expert)
            if slot is None:
                continue  # another rank's expert: never read
            target, slices, shape = out[fill.param][slot], shard.per_expert_slices(), shard.full_shape[1:]
        value = _local_value(fill, files, slices, shape, target)
        if value.shape != target.shape:
            raise CheckpointMismatch(f"{fill_sources(fill, files)}: gives {list(value.shape)} for the local slice "
                                     f"{list(target.shape)} of {fill.param} (slices {slices})",
                                     {"shape": [fill.param]})
        target.copy_(value)
        filled[fill.param].add(slot)
    check_all_filled(meta, filled, stacked={f.param for f in fills if f.expert is not None})
    return out


def _local_value(fill: Fill, files: SlicingFiles, slices: tuple[Slice, ...], full_shape: tuple[int, ...],
                 target: torch.Tensor) -> torch.Tensor:
    """The slice `slices` of the full value of one fill, in the target's dtype and device."""
    by_role = {spec.role: name for name, spec in fill.sources}
    if "mxfp4_packed" in by_role:
        packed = files.read(by_role["mxfp4_packed"]).to(target.device)
        scale = files.read(by_role["mxfp4_scale"]).to(target.device)
        return narrow_all(dequantize_mxfp4(packed, scale, target.dtype, name=fill_sources(fill, files)), slices)
    name, spec = fill.sources[0]
    if spec.role == "weight":  # stored exactly as the parameter: read only the slice
        return files.read_slice(name, slices).to(target.dtype)
    full = convert_stored(spec.role, files.read(name), torch.Size(full_shape), fill_sources(fill, files))
    return narrow_all(full, slices).to(target.dtype)


def load_dummy_sharded(model_dir: str | Path, device: torch.device, dtype: torch.dtype | str | None,
                       comm: ModelComm) -> tuple[ModelConfig, torch.nn.Module]:
    """`--load-format dummy` for a group: this rank's slice with random values made on the device, by the rules of
    shard_svc/checkpoint/dummy.py. Each parameter is seeded by its name, so replicated parameters (routers, norms)
    are identical on every rank, as the replicated routing requires; slices are not those of a one-process dummy
    model (benchmarks only)."""
    import math

    from shard_svc.parallel.group import digest

    cfg = ModelConfig.from_dir(model_dir)
    dtype = load_dtype(dtype, cfg)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype)
    model, _ = parallelize(model, comm)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen.manual_seed(digest(name))
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(torch.empty(p.shape, device=device).uniform_(1, 16, generator=gen)))
            elif leaf in ("dt_bias", "e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, device=device, generator=gen) * 0.1)
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    model.requires_grad_(False)
    return cfg, model.eval()


# --load-format for a group (shard_svc/checkpoint LOAD_FORMATS, sliced per rank)
GROUP_LOAD_FORMATS = {"safetensors": load_sharded_model, "dummy": load_dummy_sharded}
