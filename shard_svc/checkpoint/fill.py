"""What every loader of a checkpoint shares: the dtype a load gives the model, the stored tensors of one fill turned
into its parameter's layout and dtype, and the checks that every parameter was filled and nothing is left on meta.

Three loaders use them, so the streamed and the sharded model hold exactly the values the resident one does: the
resident loader (loader.py), weight streaming's host loader (shard_svc/weight_streaming/host_loader.py) and a shard
group's slice loader (shard_svc/parallel/loading.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from shard_svc.checkpoint.files import CheckpointFiles
from shard_svc.checkpoint.mxfp4 import dequantize_mxfp4
from shard_svc.checkpoint.names import DTYPES, declared_dtype
from shard_svc.checkpoint.validate import Fill
from shard_svc.config import ModelConfig
from shard_svc.errors import ConfigError, TensorValueError, UnfilledParameterError


def load_dtype(dtype: torch.dtype | str | None, cfg: ModelConfig) -> torch.dtype:
    """The dtype the model is loaded in: the one asked for (a torch dtype or its name), else the checkpoint's
    declared dtype. A name we do not know is a ConfigError naming the known ones."""
    if dtype is None:
        return declared_dtype(cfg)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (known: {sorted(DTYPES)})")
    return DTYPES[dtype]


def fill_value(fill: Fill, files: CheckpointFiles, target: torch.Tensor) -> torch.Tensor:
    """The stored tensor(s) of one fill, converted to the target slice's layout, dtype and (for MXFP4) device."""
    by_role = {spec.role: name for name, spec in fill.sources}
    if "mxfp4_packed" in by_role:
        # Dequantise where the weight will live: on a GPU this keeps the unpacking off the host.
        packed = files.read(by_role["mxfp4_packed"]).to(target.device)
        scale = files.read(by_role["mxfp4_scale"]).to(target.device)
        return dequantize_mxfp4(packed, scale, target.dtype, name=fill_sources(fill, files))
    name, spec = fill.sources[0]
    return convert_stored(spec.role, files.read(name), target.shape, fill_sources(fill, files)).to(target.dtype)


def convert_stored(role: str, stored: torch.Tensor, shape: torch.Size, where: str) -> torch.Tensor:
    """A stored tensor of one role (names.py) in its parameter's layout `shape`, still in the stored dtype. where:
    the tensor and file, for the error when the stored values cannot be taken as that layout."""
    return _CONVERT[role](stored, shape, where)


def fill_sources(fill: Fill, files: CheckpointFiles) -> str:
    """The stored tensors of one fill and their files, as errors name them."""
    return " + ".join(f"{name} ({files.tensors[name].file})" for name, _ in fill.sources)


def _a_log_padded(t: torch.Tensor, shape: torch.Size, where: str) -> torch.Tensor:
    """K3: [head_dim] with the heads' values first and zeros after; other padding is a layout we do not know."""
    heads = shape[0]
    if torch.count_nonzero(t[heads:]):
        raise TensorValueError(f"{where}: A_log stored [{t.shape[0]}] must be zero past its first {heads} entries "
                               f"(one per head), found {t[heads:].tolist()}; refusing to reinterpret")
    return t[:heads]


_CONVERT: dict[str, Callable[[torch.Tensor, torch.Size, str], torch.Tensor]] = {
    "weight": lambda t, shape, where: t,
    "a_log": lambda t, shape, where: t.reshape(shape),  # [1, 1, H, 1] -> [H]
    "a_log_padded": _a_log_padded,
}


def check_nothing_on_meta(model: torch.nn.Module) -> None:
    """A tensor the state dict does not cover (e.g. a non-persistent buffer) would still be on meta."""
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise UnfilledParameterError(f"{len(left)} model tensors were never materialised: {left[:20]}")


def check_all_filled(meta: dict[str, torch.nn.Parameter], filled: dict[str, set[int | None]],
                     stacked: set[str]) -> None:
    """Every parameter written whole (filled[name] == {None}), or every expert slice of a stacked one
    (filled[name] == all expert indices); else an UnfilledParameterError naming what is missing."""
    unfilled = []
    for name, p in meta.items():
        need = set(range(p.shape[0])) if name in stacked else {None}
        if filled[name] != need:
            done = sorted(filled[name] - {None})
            unfilled.append(f"{name} {list(p.shape)} (experts filled: {done})" if name in stacked else name)
    if unfilled:
        raise UnfilledParameterError(f"{len(unfilled)} model parameters were not fully loaded from the checkpoint: "
                                     + "; ".join(unfilled[:20]))
