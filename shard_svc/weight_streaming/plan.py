"""Where every streamed tensor of a layer lives inside a slot (and inside the layer's host arena: the same layout).

A layer's slot image is its dense tensors (attention, norms, router, shared experts, ...) followed by its routed
experts, one block per expert, every block laid out alike so a stacked `[E, ...]` view is one strided tensor and one
expert is one contiguous copy. MXFP4 experts keep their packed bytes and E8M0 scales (never dequantised on the host);
unquantised experts are stored in the model dtype. Offsets are multiples of ALIGN (the native engine checks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from shard_svc.checkpoint.mxfp4 import GROUP
from shard_svc.config import ModelConfig

ALIGN = 256
ExpertFormat = Literal["mxfp4", "dense"]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
EXPERT_PARAMS = ("w1", "w3", "w2")


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def split_layer_param(name: str) -> tuple[int, str] | None:
    """'model.layers.5.self_attn.q_proj.weight' -> (5, 'self_attn.q_proj.weight'); None for a non-layer name."""
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


@dataclass(frozen=True)
class Member:
    """One tensor of a layer's slot image."""

    name: str  # relative to the layer: 'self_attn.q_proj.weight', or 'block_sparse_moe.experts.7.w1.weight_packed'
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the slot
    nbytes: int
    expert: int | None = None
    part: str | None = None  # expert part: 'w1' (dense) or 'w1.weight_packed' (MXFP4)


@dataclass(frozen=True)
class ExpertLayout:
    """The routed experts of one MoE layer: `num` blocks of `stride` bytes from `base`; `parts` by name."""

    format: ExpertFormat
    num: int
    base: int
    stride: int
    parts: tuple[tuple[str, tuple[int, ...], torch.dtype, int], ...]  # (part, shape, dtype, offset in the block)
    module: str  # 'block_sparse_moe.experts'

    def part(self, name: str) -> tuple[tuple[int, ...], torch.dtype, int]:
        for part, shape, dtype, offset in self.parts:
            if part == name:
                return shape, dtype, offset
        raise KeyError(f"expert part {name!r} not in {[p[0] for p in self.parts]}")


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    dense: tuple[Member, ...]
    experts: ExpertLayout | None
    nbytes: int  # the whole slot image

    def members(self) -> list[Member]:
        """Every tensor of the layer in slot order (dense first, then expert blocks)."""
        out = list(self.dense)
        e = self.experts
        if e is not None:
            for i in range(e.num):
                for part, shape, dtype, off in e.parts:
                    out.append(Member(f"{e.module}.{i}.{part}", shape, dtype, e.base + i * e.stride + off,
                                      nbytes_of(shape, dtype), i, part))
        return out


def expert_parts(fmt: ExpertFormat, w1: tuple[int, ...], w2: tuple[int, ...],
                 dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """One expert's tensors. w1/w3 [I, Din], w2 [Din, I] are the model's per-expert shapes."""
    if fmt == "dense":
        return [("w1", w1, dtype), ("w3", w1, dtype), ("w2", w2, dtype)]
    out = []
    for which, (rows, cols) in (("w1", w1), ("w3", w1), ("w2", w2)):
        out.append((f"{which}.weight_packed", (rows, cols // 2), torch.uint8))
        out.append((f"{which}.weight_scale", (rows, cols // GROUP), torch.uint8))
    return out


def plan_layers(cfg: ModelConfig, model: torch.nn.Module, layers: list[int] | None = None,
                expert_format: ExpertFormat | None = None) -> dict[int, LayerPlan]:
    """Slot images for `layers` (default: every decoder layer) of a (meta or real) model. Experts stream in the
    checkpoint's format (MXFP4 stays packed) unless `expert_format` says otherwise."""
    fmt: ExpertFormat = expert_format or ("mxfp4" if cfg.quantization == "mxfp4" else "dense")
    wanted = set(range(cfg.num_layers) if layers is None else layers)
    per_layer: dict[int, list[tuple[str, torch.Tensor]]] = {i: [] for i in wanted}
    for name, p in model.named_parameters():
        split = split_layer_param(name)
        if split and split[0] in wanted:
            per_layer[split[0]].append((split[1], p))
    return {i: _plan_one(i, params, fmt) for i, params in sorted(per_layer.items())}


def _plan_one(layer: int, params: list[tuple[str, torch.Tensor]], fmt: ExpertFormat) -> LayerPlan:
    dense, offset = [], 0
    stacked: dict[str, torch.Tensor] = {}
    module = None
    for rel, p in params:
        head, _, leaf = rel.rpartition(".")
        if head.endswith("experts") and leaf in EXPERT_PARAMS:
            stacked[leaf], module = p, head
            continue
        n = nbytes_of(tuple(p.shape), p.dtype)
        dense.append(Member(rel, tuple(p.shape), p.dtype, offset, n))
        offset = align(offset + n)
    experts = None
    if stacked:
        if set(stacked) != set(EXPERT_PARAMS):
            raise AssertionError(f"layer {layer}: routed experts need w1, w3, w2; found {sorted(stacked)}")
        num, inter, width = stacked["w1"].shape
        parts, inner = [], 0
        for part, shape, dtype in expert_parts(fmt, (inter, width), tuple(stacked["w2"].shape[1:]),
                                               stacked["w1"].dtype):
            parts.append((part, shape, dtype, inner))
            inner = align(inner + nbytes_of(shape, dtype))
        experts = ExpertLayout(fmt, num, offset, inner, tuple(parts), module)
        offset += num * inner
    return LayerPlan(layer, tuple(dense), experts, align(offset))
