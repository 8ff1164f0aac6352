"""The safetensors files of one checkpoint, opened memory-mapped, with every tensor's file, shape and dtype.

A checkpoint is `model.safetensors`, or `model.safetensors.index.json` plus the shards its weight_map names. Both
in one directory (as some published checkpoints ship, and transformers loads) are accepted when they describe the same
weights: the index lists `model.safetensors` alone and its weight_map names exactly the tensors stored there.
Otherwise the directory holds two checkpoints and which one is current cannot be told: CheckpointIndexConflict.
Every safetensors failure (truncated, corrupt, unreadable) becomes a CheckpointFileError naming the file.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from shard_svc.errors import CheckpointFileError, CheckpointIndexConflict

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# safetensors header dtype strings; a string not listed here is kept as is and reported as a dtype mismatch.
_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class StoredTensor:
    file: str  # file name inside the checkpoint directory
    shape: tuple[int, ...]
    dtype: torch.dtype | str  # str: a safetensors dtype torch has no equivalent for here


class CheckpointFiles:
    """Open with `with CheckpointFiles(dir, keep_prefix) as files:`; `files.tensors` lists what is stored.

    Tensors outside `keep_prefix` (K3: the multimodal wrapper's other towers) are logged and never read.
    `problems` collects index inconsistencies for the validator to report with everything else.
    """

    def __init__(self, model_dir: Path, keep_prefix: str = ""):
        self.dir = Path(model_dir)
        self.keep_prefix = keep_prefix
        self.source, self.index_map = _find(self.dir)
        self.stored_names: dict[str, set[str]] = {}  # file -> every tensor in it, kept or skipped
        self.tensors: dict[str, StoredTensor] = {}
        self.problems: list[str] = []
        self.reads: Counter[str] = Counter()
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}

    def __enter__(self) -> "CheckpointFiles":
        try:
            for file in sorted(set(self.index_map.values())) if self.index_map else [SINGLE]:
                self._open(file)
            if self.index_map is not None and (self.dir / SINGLE).is_file():
                _require_same_tensors(self.dir, self.index_map, self.stored_names[SINGLE])
            self._check_index()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def read(self, name: str) -> torch.Tensor:
        """The tensor, read from its file; each tensor is read at most once per load."""
        if self.reads[name]:
            raise AssertionError(f"checkpoint tensor {name} read twice")
        self.reads[name] += 1
        file = self.tensors[name].file
        try:
            return self._handles[file].get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointFileError(f"{self.dir / file}: cannot read tensor {name}: {e}") from e

    def _open(self, file: str) -> None:
        path = self.dir / file
        try:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            infos = {name: handle.get_slice(name) for name in handle.keys()}
            stored = {name: StoredTensor(file, tuple(s.get_shape()), _ST_DTYPES.get(s.get_dtype(), s.get_dtype()))
                      for name, s in infos.items()}
        except (SafetensorError, OSError) as e:
            raise CheckpointFileError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e
        self._handles[file] = handle
        self.stored_names[file] = set(stored)
        skipped = [name for name in stored if not name.startswith(self.keep_prefix)]
        if skipped:
            log.info("skipping %d tensors outside %r in %s (e.g. %s)", len(skipped), self.keep_prefix, path,
                     skipped[0])
        for name, info in stored.items():
            if not name.startswith(self.keep_prefix):
                continue
            if name in self.tensors:
                self.problems.append(f"{name}: stored in both {self.tensors[name].file} and {file}")
            self.tensors[name] = info

    def _check_index(self) -> None:
        for name, file in (self.index_map or {}).items():
            stored = self.tensors.get(name)
            if name.startswith(self.keep_prefix) and (stored is None or stored.file != file):
                self.problems.append(f"{name}: {INDEX} places it in {file}, which does not hold it")
        if self.index_map:
            for name in self.tensors.keys() - self.index_map.keys():
                self.problems.append(f"{name}: in {self.tensors[name].file} but not in {INDEX}'s weight_map")


def _find(model_dir: Path) -> tuple[str, dict[str, str] | None]:
    """(description of the weights' source, the index's weight_map or None for a single file)."""
    index, single = model_dir / INDEX, model_dir / SINGLE
    if not index.is_file():
        if single.is_file():
            return SINGLE, None
        raise CheckpointFileError(f"{model_dir} holds neither {SINGLE} nor {INDEX}")
    weight_map = _read_index(index)
    files = sorted(set(weight_map.values()))
    if single.is_file():
        if files != [SINGLE]:
            raise CheckpointIndexConflict(
                f"{model_dir} holds {SINGLE} and {INDEX}, but the index places tensors in {len(files)} files "
                f"({_first(files)}), not in {SINGLE} alone: two checkpoints in one directory; remove the one that is "
                "not current")
        return f"{SINGLE} (with its {INDEX})", weight_map
    absent: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if not (model_dir / file).is_file():
            absent.setdefault(file, []).append(name)
    if absent:
        lines = [f"{file} (holds {len(names)} tensors, e.g. {names[0]})" for file, names in sorted(absent.items())]
        raise CheckpointFileError(f"{index} names shard files that do not exist in {model_dir}: " + "; ".join(lines))
    return f"{INDEX} and its {len(files)} shards", weight_map


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointFileError(f"{index}: not a valid index (need a 'weight_map' object): {e!r}") from e
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointFileError(f"{index}: weight_map must map tensor names to file names")
    return weight_map


def _require_same_tensors(model_dir: Path, weight_map: dict[str, str], stored: set[str]) -> None:
    """The index beside model.safetensors must name exactly the tensors stored in it."""
    unstored, unindexed = sorted(weight_map.keys() - stored), sorted(stored - weight_map.keys())
    if not (unstored or unindexed):
        return
    parts = [f"{len(names)} tensors {where} ({_first(names)})" for names, where in
             ((unstored, f"in {INDEX}'s weight_map are not in {SINGLE}"),
              (unindexed, f"in {SINGLE} are not in {INDEX}'s weight_map")) if names]
    raise CheckpointIndexConflict(f"{model_dir} holds {SINGLE} and {INDEX}, which describe different weights: "
                                  + "; ".join(parts) + ". Remove the one that is not current")


def _first(names: list[str], count: int = 5) -> str:
    """The first few names, and how many more."""
    return ", ".join(names[:count]) + (f", ... {len(names) - count} more" if len(names) > count else "")
