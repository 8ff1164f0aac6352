"""Streamed layers' weights in host memory: one arena per layer, laid out byte for byte like the layer's slot image.

On a CUDA machine the arenas are page-locked with cudaHostRegister (exact size; torch's pinned caching allocator
would round a 16 GiB layer up to 32 GiB), so copies are asynchronous DMA. The total is checked against the pinned
budget and against the host's available memory before anything is allocated, and the error names the sizes.
"""

from __future__ import annotations

import logging

import torch

from shard_svc.config import ModelConfig
from shard_svc.errors import UnfilledParameterError
from shard_svc.host_memory import GiB, alloc_host, check_host_memory
from shard_svc.weight_streaming.plan import ExpertFormat, LayerPlan, Member, plan_layers

log = logging.getLogger(__name__)


class HostWeights:
    """Per streamed layer: an arena (uint8) and the views of its members, plus which members have been written."""

    def __init__(self, plans: dict[int, LayerPlan], pinned: bool = False, budget_bytes: int | None = None):
        need = sum(p.nbytes for p in plans.values())
        check_host_memory(need, budget_bytes, f"streaming {len(plans)} layers")
        self.plans = plans
        self.pinned = pinned
        self.arenas: dict[int, torch.Tensor] = {}
        self._registered: list[int] = []
        self._members = {layer: {m.name: m for m in plan.members()} for layer, plan in plans.items()}
        self._filled: dict[int, set[str]] = {layer: set() for layer in plans}
        try:
            for layer, plan in plans.items():
                self.arenas[layer], registered = alloc_host(plan.nbytes, pinned)
                if registered:
                    self._registered.append(self.arenas[layer].data_ptr())
        except BaseException:
            self.close()
            raise
        log.info("host weights: %d layers, %.2f GiB %s", len(plans), need / GiB, "pinned" if pinned else "pageable")

    @property
    def slot_bytes(self) -> int:
        return max(p.nbytes for p in self.plans.values())

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.plans.values())

    def member(self, layer: int, name: str) -> Member:
        return self._members[layer][name]

    def members(self, layer: int) -> list[Member]:
        return list(self._members[layer].values())

    def view(self, layer: int, member: Member) -> torch.Tensor:
        """The member's bytes in the arena as a tensor of its shape and dtype."""
        raw = self.arenas[layer].narrow(0, member.offset, member.nbytes)
        return raw.view(member.dtype).view(member.shape)

    def write(self, layer: int, name: str, value: torch.Tensor) -> None:
        """Copies `value` into member `name` (shape and dtype must match exactly) and marks it filled."""
        m = self.member(layer, name)
        if tuple(value.shape) != m.shape or value.dtype != m.dtype:
            raise UnfilledParameterError(f"layer {layer} {name}: got {list(value.shape)} {value.dtype}, the slot image "
                                         f"holds {list(m.shape)} {m.dtype}; refusing a partial or reinterpreted copy")
        self.view(layer, m).copy_(value)
        self._filled[layer].add(name)

    def mark_written(self, layer: int) -> None:
        """Declares every member of `layer` written in place through its arena (benchmarks fill arenas directly)."""
        self._filled[layer] = set(self._members[layer])

    def check_filled(self) -> None:
        """Every member of every layer written once: never stream uninitialised host memory
        (docs/lessons.md#no-silent-wrong-output)."""
        missing = [f"layer {layer} {name}" for layer, names in self._members.items() for name in names
                   if name not in self._filled[layer]]
        if missing:
            raise UnfilledParameterError(f"{len(missing)} streamed tensors were never written: {missing[:20]}")

    def close(self) -> None:
        """Unregisters the page-locked arenas (the memory itself goes when the last view does)."""
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered = []

    def __del__(self) -> None:  # noqa: D105
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may already be gone
            pass

    @classmethod
    def from_model(cls, cfg: ModelConfig, model: torch.nn.Module, layers: list[int] | None = None,
                   pinned: bool = False, budget_bytes: int | None = None) -> "HostWeights":
        """Host copies of an in-memory model's layers; its experts are already dequantised, so stored 'dense'."""
        fmt: ExpertFormat = "dense"
        plans = plan_layers(cfg, model, layers, expert_format=fmt)
        host = cls(plans, pinned, budget_bytes)
        params = dict(model.named_parameters())
        for layer, plan in plans.items():
            prefix = f"model.layers.{layer}."
            for m in plan.dense:
                host.write(layer, m.name, params[prefix + m.name].detach().cpu())
            e = plan.experts
            if e is not None:
                for which in ("w1", "w3", "w2"):
                    stacked = params[f"{prefix}{e.module}.{which}"].detach().cpu()
                    for i in range(e.num):
                        host.write(layer, f"{e.module}.{i}.{which}", stacked[i])
        host.check_filled()
        return host
