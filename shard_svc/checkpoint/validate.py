"""Compare the expected-tensor table with what the files hold, before anything is read.

Every problem is collected first and raised as ONE CheckpointMismatch, so a broken checkpoint is diagnosed in
one run; each line names the tensor and its file. The result is the list of parameter fills to perform.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_svc.checkpoint.files import CheckpointFiles
from shard_svc.checkpoint.names import TensorSpec
from shard_svc.config import ModelConfig
from shard_svc.errors import CheckpointMismatch

MAX_LISTED = 20  # lines per kind of problem; the rest are counted
KINDS = ("missing", "unexpected", "shape", "dtype", "conflict", "index")
# Suffixes of quantised-weight formats: such a tensor in a checkpoint whose config declares no (or another)
# quantisation would be misread, so it is called out among the unexpected ones.
_QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_global_scale",
                   ".input_scale", ".qweight", ".qzeros", ".scales", ".g_idx")


@dataclass(frozen=True)
class Fill:
    """One write into a model parameter (the whole of it, or one expert's slice) from its stored tensors."""

    param: str
    expert: int | None
    sources: tuple[tuple[str, TensorSpec], ...]  # (name in the files, spec)


def plan_fills(specs: dict[str, TensorSpec], files: CheckpointFiles, cfg: ModelConfig) -> list[Fill]:
    """The fills that load every parameter; raises CheckpointMismatch listing every problem found."""
    problems: dict[str, list[str]] = {kind: [] for kind in KINDS}
    problems["index"] = list(files.problems)
    resolved: dict[str, tuple[str, TensorSpec]] = {}
    claimed: set[str] = set()
    for name, spec in specs.items():
        present = [n for n in (name, *spec.aliases) if n in files.tensors]
        claimed.update(present)
        if not present:
            problems["missing"].append(f"{name} {_describe(spec)}: not in {files.source}")
        elif len(present) > 1:
            both = " and ".join(f"{n} ({files.tensors[n].file})" for n in present)
            problems["conflict"].append(f"{both}: the same tensor under two accepted names; keep exactly one")
        else:
            resolved[name] = (present[0], spec)
            _check_one(present[0], spec, files, problems)
    for name in sorted(files.tensors.keys() - claimed):
        problems["unexpected"].append(f"{name} ({files.tensors[name].file}){_quant_note(name, cfg)}")
    if any(problems.values()):
        raise CheckpointMismatch(_message(problems, files, cfg), problems)
    return _group(resolved.values())


def _check_one(name: str, spec: TensorSpec, files: CheckpointFiles, problems: dict[str, list[str]]) -> None:
    stored = files.tensors[name]
    if stored.shape != spec.shape:
        problems["shape"].append(f"{name} ({stored.file}): shape {list(stored.shape)}, expected {list(spec.shape)}")
    if stored.dtype not in spec.dtypes:
        problems["dtype"].append(f"{name} ({stored.file}): dtype {_dtype_name(stored.dtype)}, expected "
                                 + " or ".join(_dtype_name(d) for d in spec.dtypes))


def _quant_note(name: str, cfg: ModelConfig) -> str:
    if name.endswith(_QUANT_SUFFIXES):
        return (f" [a quantised-weight suffix that config.json (quantization={cfg.quantization!r}) does not declare"
                " for this tensor; refusing to reinterpret]")
    return ""


def _group(resolved) -> list[Fill]:
    """Specs that fill the same parameter slice (an MXFP4 packed + scale pair) become one Fill; order is kept."""
    groups: dict[tuple[str, int | None], list[tuple[str, TensorSpec]]] = {}
    for stored_name, spec in resolved:
        groups.setdefault((spec.param, spec.expert), []).append((stored_name, spec))
    return [Fill(param, expert, tuple(sources)) for (param, expert), sources in groups.items()]


def _describe(spec: TensorSpec) -> str:
    return f"{list(spec.shape)} " + "|".join(_dtype_name(d) for d in spec.dtypes)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _message(problems: dict[str, list[str]], files: CheckpointFiles, cfg: ModelConfig) -> str:
    counts = ", ".join(f"{len(lines)} {kind}" for kind, lines in problems.items() if lines)
    head = (f"checkpoint {files.dir} ({files.source}) does not match its config.json (model_type {cfg.model_type}, "
            f"torch_dtype {cfg.torch_dtype}, quantization {cfg.quantization}): {counts}")
    parts = [head]
    for kind, lines in problems.items():
        if lines:
            parts.append(f"{kind} ({len(lines)}):")
            parts += [f"  {line}" for line in lines[:MAX_LISTED]]
            if len(lines) > MAX_LISTED:
                parts.append(f"  ... and {len(lines) - MAX_LISTED} more")
    return "\n".join(parts)
