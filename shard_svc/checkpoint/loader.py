"""Load a checkpoint directory in the published on-disk format into a KimiForCausalLM.

Order of work: parse config.json; build the model on the meta device; open the safetensors files (memory-mapped)
and validate every tensor's presence, shape and dtype against the expected table, raising one error that lists
all problems; only then materialise each parameter on the target device, reading each stored tensor once, and
check every parameter was filled (never run on init values or stale memory: docs/lessons.md#no-silent-wrong-output).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from shard_svc.checkpoint.files import CheckpointFiles
from shard_svc.checkpoint.mxfp4 import dequantize_mxfp4
from shard_svc.checkpoint.names import DTYPES, declared_dtype, tensor_specs
from shard_svc.checkpoint.validate import Fill, plan_fills
from shard_svc.config import ModelConfig
from shard_svc.errors import CheckpointMismatch, ConfigError, TensorValueError, UnfilledParameterError
from shard_svc.model import KimiForCausalLM

log = logging.getLogger(__name__)

PROGRESS_DELAY_S = 2.0  # the bar appears only when loading takes longer than this


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = None) -> tuple[ModelConfig, KimiForCausalLM]:
    """(config, model with every parameter loaded on `device`). dtype None: the checkpoint's declared dtype."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    dtype = _resolve_dtype(dtype, cfg)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype)
    specs = tensor_specs(cfg, model)
    with CheckpointFiles(model_dir, keep_prefix=cfg.tensor_prefix) as files:
        fills = plan_fills(specs, files, cfg)
        params = _materialise(model, fills, files, torch.device(device))
    model.load_state_dict(params, strict=True, assign=True)
    model.requires_grad_(False)  # serving never trains; no autograd bookkeeping on any parameter
    _check_nothing_on_meta(model)
    log.info("loaded %s (%s, %d tensors) on %s as %s", model_dir, cfg.model_type, sum(files.reads.values()),
             device, dtype)
    return cfg, model.eval()


def _resolve_dtype(dtype: torch.dtype | str | None, cfg: ModelConfig) -> torch.dtype:
    if dtype is None:
        return declared_dtype(cfg)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (known: {sorted(DTYPES)})")
    return DTYPES[dtype]


def _materialise(model: KimiForCausalLM, fills: list[Fill], files: CheckpointFiles,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """Fresh tensors for every parameter, each slice written from the checkpoint exactly once."""
    meta = dict(model.named_parameters())
    out = {name: torch.empty(p.shape, dtype=p.dtype, device=device) for name, p in meta.items()}
    filled: dict[str, set[int | None]] = {name: set() for name in meta}
    from tqdm import tqdm  # here, not at the top: the training script imports this package where tqdm is absent

    bar = tqdm(fills, desc=f"loading {files.dir.name}", unit="tensor", file=sys.stderr, delay=PROGRESS_DELAY_S,
               disable=not sys.stderr.isatty())
    for fill in bar:
        target = out[fill.param] if fill.expert is None else out[fill.param][fill.expert]
        value = _value(fill, files, target)
        if value.shape != target.shape:  # the validator's table and the model disagree: never copy partially
            raise CheckpointMismatch(f"{_where(fill, files)}: gives {list(value.shape)} for {fill.param} slice "
                                     f"{list(target.shape)}", {"shape": [fill.param]})
        target.copy_(value)
        filled[fill.param].add(fill.expert)
    _check_all_filled(meta, filled, stacked={f.param for f in fills if f.expert is not None})
    return out


def _value(fill: Fill, files: CheckpointFiles, target: torch.Tensor) -> torch.Tensor:
    """The stored tensor(s) of one fill, converted to the target slice's layout and dtype."""
    by_role = {spec.role: name for name, spec in fill.sources}
    if "mxfp4_packed" in by_role:
        # Dequantise where the weight will live: on a GPU this keeps the unpacking off the host.
        packed = files.read(by_role["mxfp4_packed"]).to(target.device)
        scale = files.read(by_role["mxfp4_scale"]).to(target.device)
        return dequantize_mxfp4(packed, scale, target.dtype, name=_where(fill, files))
    name, spec = fill.sources[0]
    return _CONVERT[spec.role](files.read(name), target.shape, _where(fill, files)).to(target.dtype)


def _where(fill: Fill, files: CheckpointFiles) -> str:
    return " + ".join(f"{name} ({files.tensors[name].file})" for name, _ in fill.sources)


def _a_log_padded(t: torch.Tensor, shape: torch.Size, where: str) -> torch.Tensor:
    """K3: [head_dim] with the heads' values first and zeros after; other padding is a layout we do not know."""
    heads = shape[0]
    if torch.count_nonzero(t[heads:]):
        raise TensorValueError(f"{where}: A_log stored [{t.shape[0]}] must be zero past its first {heads} entries "
                               f"(one per head), found {t[heads:].tolist()}; refusing to reinterpret")
    return t[:heads]


def _check_nothing_on_meta(model: KimiForCausalLM) -> None:
    """A tensor the state dict does not cover (e.g. a non-persistent buffer) would still be on meta."""
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise UnfilledParameterError(f"{len(left)} model tensors were never materialised: {left[:20]}")


def _check_all_filled(meta: dict[str, torch.nn.Parameter], filled: dict[str, set[int | None]],
                      stacked: set[str]) -> None:
    """Every parameter written whole, or every expert slice of a stacked one."""
    unfilled = []
    for name, p in meta.items():
        need = set(range(p.shape[0])) if name in stacked else {None}
        if filled[name] != need:
            done = sorted(filled[name] - {None})
            unfilled.append(f"{name} {list(p.shape)} (experts filled: {done})" if name in stacked else name)
    if unfilled:
        raise UnfilledParameterError(f"{len(unfilled)} model parameters were not fully loaded from the checkpoint: "
                                     + "; ".join(unfilled[:20]))


_CONVERT = {
    "weight": lambda t, shape, where: t,
    "a_log": lambda t, shape, where: t.reshape(shape),  # [1, 1, H, 1] -> [H]
    "a_log_padded": _a_log_padded,
}
