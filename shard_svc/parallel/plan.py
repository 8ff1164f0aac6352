"""The record of which slice of each full parameter a rank holds, written by the code that slices the modules and
read by the loader, so the two cannot disagree."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

Slice = tuple[int, int, int]  # (dim of the full parameter, start, size)


def narrow_all(t: torch.Tensor, slices: tuple[Slice, ...]) -> torch.Tensor:
    for dim, start, size in slices:
        t = t.narrow(dim, start, size)
    return t


@dataclass(frozen=True)
class ParamShard:
    full_shape: tuple[int, ...]
    slices: tuple[Slice, ...]

    def local_expert(self, expert: int) -> int | None:
        """For stacked routed experts [E, ...] sliced on dim 0: the local index of global `expert`, or None when
        another rank holds it."""
        for dim, start, size in self.slices:
            if dim == 0:
                return expert - start if start <= expert < start + size else None
        return expert

    def per_expert_slices(self) -> tuple[Slice, ...]:
        """The slices of one expert's tensor (the stacked dims shifted down by one)."""
        return tuple((dim - 1, start, size) for dim, start, size in self.slices if dim > 0)

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        for dim, _, size in self.slices:
            shape[dim] = size
        return tuple(shape)


@dataclass
class ShardPlan:
    params: dict[str, ParamShard] = field(default_factory=dict)  # absent: replicated, held whole by every rank

    def narrow(self, module: nn.Module, qualified: str, attr: str, *slices: Slice) -> None:
        """Replaces `module.attr` by its slice (a view on the meta device, an owned copy otherwise) and records it
        under the parameter's full name `qualified.attr`."""
        name = f"{qualified}.{attr}"
        if name in self.params:
            raise AssertionError(f"parameter {name} sliced twice")
        full = getattr(module, attr)
        part = narrow_all(full.detach(), slices)
        if not part.is_meta:
            part = part.clone()  # contiguous, and the full tensor's storage can be freed
        setattr(module, attr, nn.Parameter(part, requires_grad=False))
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = part.shape
        self.params[name] = ParamShard(tuple(full.shape), tuple(slices))
