"""`--weights stream`: load a checkpoint with its decoder layers in host memory and the rest on the device.

The same validation as the resident loader runs first (one CheckpointMismatch listing every problem, nothing
allocated for a broken checkpoint) and non-expert values go through the resident loader's own conversions, so a
streamed layer holds bit for bit what a resident one would. MXFP4 routed experts are NOT dequantised: their packed
bytes and E8M0 scales are written to the host arena as stored (a scale byte stays an exponent; 255 is refused).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shard_svc.checkpoint import fill_value, load_dtype  # the resident path's conversions (parity)
from shard_svc.checkpoint.files import CheckpointFiles
from shard_svc.checkpoint.mxfp4 import E8M0_NAN, dequantize_mxfp4
from shard_svc.checkpoint.names import tensor_specs
from shard_svc.checkpoint.validate import Fill, plan_fills
from shard_svc.config import ModelConfig
from shard_svc.errors import CheckpointMismatch, NaNScaleError, UnfilledParameterError
from shard_svc.model import KimiForCausalLM
from shard_svc.weight_streaming.host import HostWeights
from shard_svc.weight_streaming.plan import plan_layers, split_layer_param

log = logging.getLogger(__name__)

# Scale bytes from here up may overflow the target dtype once multiplied by 6; such rows are dequantised once at
# load time (as the resident loader would) so the same TensorValueError is raised.
_OVERFLOW_RISK = 250


def load_streamed(model_dir: str | Path, device: str | torch.device, dtype: torch.dtype | str | None = None,
                  budget_bytes: int | None = None) -> tuple[ModelConfig, KimiForCausalLM, HostWeights]:
    """(config, model with its non-layer tensors on `device` and its layers still on meta, host weights)."""
    model_dir, device = Path(model_dir), torch.device(device)
    cfg = ModelConfig.from_dir(model_dir)
    dtype = load_dtype(dtype, cfg)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype)
    specs = tensor_specs(cfg, model)
    plans = plan_layers(cfg, model)
    with CheckpointFiles(model_dir, keep_prefix=cfg.tensor_prefix) as files:
        fills = plan_fills(specs, files, cfg)
        host = HostWeights(plans, pinned=device.type == "cuda", budget_bytes=budget_bytes)
        resident: dict[str, torch.Tensor] = {}
        meta = dict(model.named_parameters())
        for fill in fills:
            split = split_layer_param(fill.param)
            if split is None:
                target = torch.empty(meta[fill.param].shape, dtype=meta[fill.param].dtype, device=device)
                target.copy_(_checked(fill_value(fill, files, target), target, fill, files))
                resident[fill.param] = target
            else:
                _write_layer_fill(host, split[0], split[1], fill, files, dtype)
    missing = sorted(n for n, p in meta.items() if split_layer_param(n) is None and n not in resident)
    if missing:
        raise UnfilledParameterError(f"{len(missing)} resident parameters were not loaded: {missing[:20]}")
    model.load_state_dict(resident, strict=False, assign=True)
    model.requires_grad_(False)
    host.check_filled()
    log.info("loaded %s for streaming: %d layers (%.2f GiB) in host memory, the rest on %s", model_dir, len(plans),
             host.total_bytes / (1 << 30), device)
    return cfg, model.eval(), host


def _write_layer_fill(host: HostWeights, layer: int, rel: str, fill: Fill, files: CheckpointFiles,
                      dtype: torch.dtype) -> None:
    plan = host.plans[layer]
    if fill.expert is None:
        m = host.member(layer, rel)
        view = host.view(layer, m)
        host.write(layer, rel, _checked(fill_value(fill, files, view), view, fill, files))
        return
    which = rel.rsplit(".", 1)[1]  # 'w1' | 'w3' | 'w2'
    stem = f"{plan.experts.module}.{fill.expert}.{which}"
    by_role = {spec.role: name for name, spec in fill.sources}
    if plan.experts.format == "dense":
        view = host.view(layer, host.member(layer, stem))
        host.write(layer, stem, _checked(fill_value(fill, files, view), view, fill, files))
        return
    packed = files.read(by_role["mxfp4_packed"])
    scale = files.read(by_role["mxfp4_scale"])
    where = " + ".join(f"{n} ({files.tensors[n].file})" for n, _ in fill.sources)
    bad = int((scale == E8M0_NAN).sum())
    if bad:
        raise NaNScaleError(f"{where}: {bad} E8M0 scale bytes are 255 (NaN per the OCP MX spec); refusing to stream")
    risky = (scale >= _OVERFLOW_RISK).any(dim=1).nonzero().flatten()
    if len(risky):
        dequantize_mxfp4(packed[risky], scale[risky], dtype, name=where)  # raises TensorValueError on overflow
    host.write(layer, f"{stem}.weight_packed", packed)
    host.write(layer, f"{stem}.weight_scale", scale)


def _checked(value: torch.Tensor, target: torch.Tensor, fill: Fill, files: CheckpointFiles) -> torch.Tensor:
    if value.shape != target.shape:
        where = " + ".join(f"{n} ({files.tensors[n].file})" for n, _ in fill.sources)
        raise CheckpointMismatch(f"{where}: gives {list(value.shape)} for {fill.param} slice {list(target.shape)}",
                                 {"shape": [fill.param]})
    return value.to(target.dtype)
