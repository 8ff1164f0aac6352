"""Leaf modules shared by every block. Parameters are created empty: the loader fills every one of them.

Packed weights: a block whose linears multiply the same input (KDA's q/k/v, MLA's q_a / kv_a, an MLP's gate / up)
names them in `packed_groups`; `pack_rows` (run once per group by `kimi.pack_weights`) stacks each group's weights
in one buffer that the checkpoint-named parameters then view, and `joint_linear` / `split_linear` run such a group
as one product over that buffer. A group whose weights are not packed (a streamed layer's parameters, bound to slot
views per pass) runs the same one product over its weights concatenated per call: per-module products would differ
in the last bit (a GEMM's summation order depends on N: MKL on a few-row tail, the Triton skinny GEMM's split-K),
and a streamed layer must compute exactly what the resident layer does.
"""

from collections.abc import Sequence

import torch
from torch import nn


class Linear(nn.Linear):
    """nn.Linear without bias whose forward runs the op seam's `linear`, so a backend can serve decode-sized
    products with its own kernel. The parameter (`weight`), its name and the nn.Linear type that tensor parallelism
    narrows are unchanged."""

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return ops.linear(x, self.weight)


def linear(out_features: int, in_features: int, dtype: torch.dtype) -> Linear:
    return Linear(in_features, out_features, bias=False, dtype=dtype)


def packed_rows(params: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """`torch.cat(params)` without a copy: a view of their common storage when they lie back to back in it (as
    `pack_rows` leaves them); None otherwise. Host-side checks only: no copy, no device sync."""
    first = params[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in params:
        if (p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset or not p.is_contiguous()
                or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]):
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in params)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


@torch.no_grad()
def pack_rows(modules: Sequence[nn.Module], attr: str = "weight") -> bool:
    """Moves the `attr` parameters of `modules` into one new buffer, stacked on dim 0, and rebinds each as a view of
    its rows: names, shapes and values are unchanged and nothing is held twice, so `packed_rows` then returns the
    whole buffer for free. False (nothing changed) when a parameter is not materialised (on the meta device, e.g. a
    streamed layer's placeholder) or the parts differ in dtype, device or trailing shape."""
    params = [getattr(m, attr) for m in modules]
    first = params[0]
    if any(p.is_meta or p.dtype != first.dtype or p.device != first.device or p.shape[1:] != first.shape[1:]
           for p in params):
        return False
    if packed_rows(params) is None:
        buf = torch.cat([p.detach() for p in params])
        start = 0
        for module, p in zip(modules, params):
            setattr(module, attr, nn.Parameter(buf[start:start + p.shape[0]], requires_grad=False))
            start += p.shape[0]
    return True


class PackedWeights(nn.Module):
    """A module with groups of weights that `kimi.pack_weights` packs (see the module docstring)."""

    def packed_groups(self) -> list[tuple[nn.Module, ...]]:
        """The groups, each packed on its modules' `weight`s in this order (the order of the joint product's
        columns)."""
        raise NotImplementedError


def stacked_weight(modules: Sequence[nn.Module]) -> torch.Tensor:
    """The modules' weights stacked on dim 0: a view of their packed buffer, else a per-call concatenation."""
    params = [m.weight for m in modules]
    w = packed_rows(params)
    return torch.cat(params) if w is None else w


def joint_linear(x: torch.Tensor, modules: Sequence[Linear], ops) -> torch.Tensor:
    """[..., sum of out features]: one product of x and the stacked weights, each module's output in its columns."""
    return ops.linear(x, stacked_weight(modules))


def split_linear(x: torch.Tensor, modules: Sequence[Linear], ops) -> tuple[torch.Tensor, ...]:
    """Each module's product with x, as column views of `joint_linear` (not contiguous for more than one row)."""
    return joint_linear(x, modules, ops).split([m.weight.shape[0] for m in modules], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_then_norm(self, x: torch.Tensor, residual: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of residual + x, residual + x)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)
