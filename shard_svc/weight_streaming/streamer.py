"""The weight-streaming wrapper: a model whose decoder layers live in host memory and run from a ring of device slots.

`WeightStreamer.install` edits the model after construction (as tensor parallelism does elsewhere): each streamed
layer becomes a `StreamedDecoderLayer`, its parameters become `UnboundWeight` placeholders that raise
MissingSlotError on any use, and its stacked experts become `StreamedExperts` handles. Per forward pass
(`pass_scope`, entered by the runner) the first `prefetch_depth` layers are fetched unless the previous pass already
did; when layer l acquires its slot the streamer fetches layer l + depth, binds l's parameters to views of the slot,
runs it, then puts the placeholders back and releases the slot (an event on the compute stream: the slot is refilled
only after the kernels that read it).

Across passes: a forward always starts at the first streamed layer, so once l + depth runs past the last layer the
ring wraps and the next pass's first `prefetch_depth` layers are fetched while this pass's last layers compute (the
next pass then starts warm). Each goes into a slot only after its own release in this pass, in ring order, with the
same event guard. A pass that fails drains the ring, so the next one starts cold rather than on a half-known state.

Routed experts: when the pass is expected to touch fewer than `all_experts_share` of a layer's experts (decode, small
batches), only the layer's dense tensors are prefetched and the experts its tokens route to are copied on demand;
otherwise every expert is prefetched with the layer. Before experts are read the engine checks that each was copied
into this slot in this occupancy. Fetching ahead for the next pass, whose size is not known yet, the streamer takes
the engine's word for it (`expect_next_pass`: a prefill is followed by the step's decode) or else assumes the next
pass is like this one. A guess that turns out wrong costs copies, never correctness: a layer fetched with every
expert serves a routed pass (its on-demand copies find the experts already there), and a layer fetched with its dense
tensors only gets the rest of its experts copied when an all-experts pass acquires it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Literal

import torch

from shard_svc.config import ModelConfig
from shard_svc.model.kimi import DecoderLayer, KimiForCausalLM
from shard_svc.ops import Ops
from shard_svc.weight_streaming.errors import MissingSlotError, StreamingConfigError, UnusedPrefetchError
from shard_svc.weight_streaming.experts import StreamedExperts, w4a16_moe_experts
from shard_svc.weight_streaming.host import HostWeights
from shard_svc.weight_streaming.metrics import StreamingMetrics
from shard_svc.weight_streaming.native import load_native

log = logging.getLogger(__name__)

# Tensor metadata a placeholder may answer; anything that would read its values raises.
_METADATA = frozenset({"shape", "dtype", "device", "ndim", "is_meta", "requires_grad", "numel", "dim", "size",
                       "element_size", "nbytes", "itemsize", "is_cuda", "layout", "requires_grad_"})


class UnboundWeight(torch.Tensor):
    """A streamed parameter while its layer holds no slot. Any computation with it raises MissingSlotError, so a
    missed fetch can never fall through to stale or uninitialised weights (docs/lessons.md#no-silent-wrong-output)."""

    stream_name: str

    @staticmethod
    def make(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> "UnboundWeight":
        t = torch.Tensor._make_subclass(UnboundWeight, torch.empty(shape, dtype=dtype, device="meta"))
        t.stream_name = name
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        names = {getattr(func, "__name__", ""), getattr(getattr(func, "__self__", None), "__name__", "")}
        if names & _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise MissingSlotError(f"{_unbound_name(args)} was used while its layer holds no device slot (outside the "
                               f"layer's acquisition, or the layer was never fetched); refusing to compute ({func})")


def _unbound_name(args) -> str:
    for a in args:
        if isinstance(a, UnboundWeight):
            return a.stream_name
        if isinstance(a, (list, tuple)):
            found = _unbound_name(a)
            if found != "a streamed weight":
                return found
    return "a streamed weight"


class StreamedDecoderLayer(DecoderLayer):
    """A decoder layer that runs only while its weights are in a slot (set up by `WeightStreamer.install`)."""

    _streamer: "WeightStreamer"

    def forward(self, h: torch.Tensor, pending: torch.Tensor | None, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        with self._streamer.layer_scope(self.idx):
            return super().forward(h, pending, ctx)

    def forward_attn_res(self, x: torch.Tensor, carry, ctx) -> torch.Tensor:
        with self._streamer.layer_scope(self.idx):
            return super().forward_attn_res(x, carry, ctx)


@dataclass(frozen=True)
class StreamOptions:
    prefetch_depth: int = 2  # layers fetched ahead of the one computing
    num_slots: int | None = None  # device slots in the ring; default prefetch_depth + 1 (the minimum)
    pinned_budget_bytes: int | None = None  # host memory the streamed layers may page-lock; None: what is available
    all_experts_share: float = 0.5  # prefetch every expert when a pass should touch at least this share of them
    expert_mode: Literal["auto", "all", "routed"] = "auto"


@dataclass(frozen=True)
class PassStreamStats:
    bytes: int
    tensors: int
    copies: int
    copy_s: float
    compute_s: float  # time streamed layers held their slots, minus the initial wait (includes on-demand waits)
    stall_s: float  # time the compute side waited for copies
    wall_s: float
    routed: bool  # experts copied on demand (True) or all prefetched
    ready: int  # first layers found already fetched (by the previous pass) when this pass started
    ahead: int  # layer fetches this pass issued for the next pass (its bytes and copy time are counted here)


class WeightStreamer:
    def __init__(self, cfg: ModelConfig, model: KimiForCausalLM, host: HostWeights, device: torch.device | str,
                 options: StreamOptions = StreamOptions(), metrics: StreamingMetrics | None = None):
        depth = options.prefetch_depth
        num_slots = options.num_slots or depth + 1
        if depth < 1 or num_slots < depth + 1:
            raise StreamingConfigError(f"prefetch depth {depth} with {num_slots} slots: the depth must be at least 1 "
                                       f"and the ring needs depth + 1 slots (a slot is refilled only after its layer "
                                       f"released it)")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.cfg, self.host, self.device, self.options = cfg, host, device, options
        self.depth, self.metrics = depth, metrics
        self.native = load_native(self.device)
        # CUDA: a copy stream for prefetches and a high-priority one for on-demand experts (kept alive here).
        self._streams = ((torch.cuda.Stream(device), torch.cuda.Stream(device, priority=-1))
                         if device.type == "cuda" else ())
        handles = [st.cuda_stream for st in self._streams] or [0, 0]
        self.engine = self.native.StreamEngine(num_slots, host.slot_bytes, str(self.device), *handles)
        self.order = sorted(host.plans)
        self._pos = {layer: i for i, layer in enumerate(self.order)}
        self._dense_ids: dict[int, list[int]] = {}
        self._expert_ids: dict[int, list[list[int]]] = {}
        self._all_expert_ids: dict[int, list[int]] = {}
        self._register()
        self._targets: dict[int, list[tuple[torch.nn.Module, str, UnboundWeight]]] = {}
        self._views: dict[tuple[int, int], object] = {}
        self._slot: dict[int, int] = {}
        # Layers fetched into a slot and not yet acquired -> whether every member (all experts) was copied. Between
        # passes it holds the next pass's first layers, fetched ahead.
        self._fetched: dict[int, bool] = {}
        self._in_pass = False
        self._routed = False
        self._next_routed = False  # expert mode the fetches for the next pass are made for
        self._next_tokens: int | None = None  # set by `expect_next_pass`, consumed by the next pass_scope
        self._ahead = 0
        self._w4a16 = w4a16_moe_experts  # wrap_ops picks the backend's kernel
        self.last_pass: PassStreamStats | None = None
        self.install(model)
        if metrics is not None:
            metrics.set_slots(0, num_slots)
        log.info("weight streaming: %d layers from %s host memory (%.2f GiB), %d slots of %.2f GiB on %s, prefetch "
                 "depth %d, %s engine", len(self.order), "pinned" if host.pinned else "pageable",
                 host.total_bytes / (1 << 30), num_slots, self.engine.slot_bytes / (1 << 30), self.device, depth,
                 self.device.type)

    # -- setup ----------------------------------------------------------------------------------------------------
    def _register(self) -> None:
        for layer, plan in self.host.plans.items():
            ids, offsets, sizes = [], [], []
            per_expert: list[list[int]] = [[] for _ in range(plan.experts.num if plan.experts else 0)]
            dense: list[int] = []
            for m in plan.members():
                hid = self.engine.add_host(self.host.view(layer, m), f"model.layers.{layer}.{m.name}")
                ids.append(hid)
                offsets.append(m.offset)
                sizes.append(m.nbytes)
                (dense if m.expert is None else per_expert[m.expert]).append(hid)
            self.engine.set_members(layer, ids)
            self.engine.set_slot_map(layer, ids, offsets, sizes)
            self._dense_ids[layer], self._expert_ids[layer] = dense, per_expert
            self._all_expert_ids[layer] = [hid for hids in per_expert for hid in hids]

    def install(self, model: KimiForCausalLM) -> None:
        """Swaps each streamed layer's parameters for placeholders and its class for StreamedDecoderLayer."""
        layers = model.model.layers
        for idx in self.order:
            layer, plan = layers[idx], self.host.plans[idx]
            targets = []
            for m in plan.dense:
                module_name, _, attr = m.name.rpartition(".")
                module = layer.get_submodule(module_name) if module_name else layer
                placeholder = UnboundWeight.make(f"model.layers.{idx}.{m.name}", m.shape, m.dtype)
                module._parameters[attr] = placeholder
                targets.append((module, attr, placeholder))
            self._targets[idx] = targets
            if plan.experts is not None:
                experts = layer.get_submodule(plan.experts.module)
                for which in ("w1", "w3", "w2"):
                    delattr(experts, which)
                    object.__setattr__(experts, which, StreamedExperts(idx, which))
            layer.__class__ = StreamedDecoderLayer
            object.__setattr__(layer, "_streamer", self)

    def wrap_ops(self, ops: Ops) -> Ops:
        """The runner's ops with `moe_experts` routed to the slots for streamed layers (others unchanged). Packed
        MXFP4 experts run the W4A16 kernel of the backend that serves `moe_experts` (Triton: the fused kernel;
        eager: the reference loop), chosen here once and logged."""
        backend = dict(ops.backends).get("moe_experts", "eager")
        if backend == "triton":
            from shard_svc.ops.triton.moe_w4a16 import moe_experts_w4a16

            self._w4a16 = moe_experts_w4a16
        else:
            self._w4a16 = w4a16_moe_experts
        log.info("streamed MXFP4 experts: %s W4A16 (%s.%s)", backend, self._w4a16.__module__, self._w4a16.__name__)
        relabel = {"moe_experts": f"{backend}+stream", "moe_experts_shared": "composed in the model"}
        backends = tuple((n, relabel.get(n, b)) for n, b in ops.backends)
        # no fused shared-expert op: it would bypass the slots; the model composes it around the routed experts
        return dataclasses.replace(ops, moe_experts=functools.partial(self._moe_experts, ops.moe_experts),
                                   moe_experts_shared=None, backends=backends)

    def attach(self, runner) -> None:
        """Hooks into a ModelRunner: it enters `pass_scope` around each forward and calls the wrapped ops."""
        runner.map_ops(self.wrap_ops)
        runner.weights = self

    # -- per pass -------------------------------------------------------------------------------------------------
    def routed_for(self, num_tokens: int) -> bool:
        """Copy only routed experts (True) or prefetch them all, for a pass of `num_tokens` tokens."""
        mode = self.options.expert_mode
        if mode != "auto":
            return mode == "routed"
        m = self.cfg.moe
        if not m.num_experts:
            return False
        touched = 1.0 - (1.0 - m.top_k / m.num_experts) ** num_tokens
        return touched < self.options.all_experts_share

    def expect_next_pass(self, num_tokens: int | None) -> None:
        """Called before a pass: the pass that follows it will run `num_tokens` tokens (None: unknown). Decides
        whether the layers fetched ahead for that pass carry every expert or only their dense tensors; a wrong or
        missing hint costs copies, never correctness."""
        self._next_tokens = num_tokens

    @contextmanager
    def pass_scope(self, batch, num_tokens: int) -> Iterator[None]:
        self._routed = self.routed_for(num_tokens)
        hint, self._next_tokens = self._next_tokens, None
        self._next_routed = self._routed if hint is None else self.routed_for(hint)
        self.engine.reset_stats()
        start = time.perf_counter()
        first = self.order[: self.depth]
        ready = sum(layer in self._fetched for layer in first)
        self._ahead = 0
        self._in_pass = True
        completed = False
        try:
            for layer in first:
                if layer not in self._fetched:
                    self._fetch(layer, self._routed)
            yield
            self._fetch_ahead(len(self.order))  # what the last layer's release made room for (depth >= layers)
            self._check_only_next_pass_fetched()
            completed = True
        finally:
            self._in_pass = False
            if not completed:
                self.discard_prefetch()  # an aborted pass leaves no prefetch behind to block the next one
            s = self.engine.stats()
            self.last_pass = PassStreamStats(s["bytes"], s["tensors"], s["copies"], s["copy_s"], s["compute_s"],
                                             s["stall_s"], time.perf_counter() - start, self._routed, ready,
                                             self._ahead)
            if self.metrics is not None:
                self.metrics.observe_pass(s["bytes"], s["tensors"], s["copy_s"], s["compute_s"], s["stall_s"],
                                          self._ahead)
                self.metrics.set_slots(self.engine.occupancy(), self.engine.num_slots)

    def discard_prefetch(self) -> None:
        """Waits for every queued copy and frees the slots of layers fetched but not acquired (the next pass then
        fetches its first layers itself)."""
        self.engine.drain()
        self._fetched.clear()

    def _fetch(self, layer: int, routed: bool) -> None:
        dense_only = routed and self.host.plans[layer].experts is not None
        self.engine.fetch(layer, self._dense_ids[layer] if dense_only else None)
        self._fetched[layer] = not dense_only

    def _fetch_ahead(self, pos: int) -> None:
        """Fetches the next pass's layer at position q once this pass has released it (q < pos) and is within
        `depth` layers of its end (q + layers - depth <= pos): the ring keeps its order and its depth across passes."""
        n = len(self.order)
        for q in range(min(self.depth, n, pos)):
            layer = self.order[q]
            if q + n - self.depth <= pos and layer not in self._fetched:
                self._fetch(layer, self._next_routed)
                self._ahead += 1

    def _check_only_next_pass_fetched(self) -> None:
        stray = sorted(set(self._fetched) - set(self.order[: self.depth]))
        if stray:
            raise UnusedPrefetchError(f"the forward pass ended with streamed layers {stray} fetched for it but never "
                                      f"run (the model skipped them); slots hold {self.engine.slots_state()}")

    @contextmanager
    def layer_scope(self, layer: int) -> Iterator[int]:
        if not self._in_pass:
            raise MissingSlotError(f"streamed layer {layer} ran outside a forward pass's pass_scope: nothing fetched "
                                   "its weights (is the streamer attached to the runner?)")
        stream = self._compute_stream()
        slot = self.engine.acquire(layer, stream)
        complete = self._fetched.pop(layer)
        self._slot[layer] = slot
        targets = self._targets[layer]
        try:
            if not (complete or self._routed):  # fetched ahead with its dense tensors only: the experts now
                self.engine.fetch_into(layer, self._all_expert_ids[layer], stream)
            pos = self._pos[layer]
            if pos + self.depth < len(self.order):
                self._fetch(self.order[pos + self.depth], self._routed)
            self._fetch_ahead(pos)
            for (module, attr, _), view in zip(targets, self._dense_views(layer, slot)):
                module._parameters[attr] = view
            if self.metrics is not None:
                self.metrics.set_slots(self.engine.occupancy(), self.engine.num_slots)
            yield slot
        finally:
            for module, attr, placeholder in targets:
                module._parameters[attr] = placeholder
            del self._slot[layer]
            self.engine.release(layer, stream)

    def _compute_stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0

    # -- views of a slot ------------------------------------------------------------------------------------------
    def _dense_views(self, layer: int, slot: int) -> list[torch.Tensor]:
        key = (layer, slot)
        if key not in self._views:
            buf = self.engine.slot(slot)
            self._views[key] = [buf.narrow(0, m.offset, m.nbytes).view(m.dtype).view(m.shape)
                                for m in self.host.plans[layer].dense]
        return self._views[key]  # type: ignore[return-value]

    def _expert_views(self, layer: int, slot: int) -> dict:
        key = (layer, -1 - slot)
        if key not in self._views:
            e, buf = self.host.plans[layer].experts, self.engine.slot(slot)
            parts = {}
            for part, shape, dtype, offset in e.parts:
                size = dtype.itemsize
                inner = [1] * len(shape)
                for i in range(len(shape) - 2, -1, -1):
                    inner[i] = inner[i + 1] * shape[i + 1]
                parts[part] = torch.as_strided(buf.view(dtype), (e.num, *shape), (e.stride // size, *inner),
                                               (e.base + offset) // size)
            if e.format == "mxfp4":
                parts = {w: (parts[f"{w}.weight_packed"], parts[f"{w}.weight_scale"]) for w in ("w1", "w3", "w2")}
            self._views[key] = parts
        return self._views[key]  # type: ignore[return-value]

    def _moe_experts(self, base, x, weights, ids, w1, w3, w2, activation, situ_betas):
        if not isinstance(w1, StreamedExperts):
            return base(x, weights, ids, w1, w3, w2, activation, situ_betas)
        layer = w1.layer
        slot = self._slot.get(layer)
        if slot is None:
            raise MissingSlotError(f"experts of layer {layer} were called while the layer holds no slot")
        per_expert = self._expert_ids[layer]
        if self._routed:  # one host sync: which experts the batch routes to
            wanted = [hid for e in torch.unique(ids).tolist() for hid in per_expert[e]]
            self.engine.fetch_into(layer, wanted, self._compute_stream())
        else:  # every expert was prefetched with the layer: no host sync, the slot must hold them all
            wanted = self._all_expert_ids[layer]
        self.engine.check_valid(layer, wanted)
        views = self._expert_views(layer, slot)
        if self.host.plans[layer].experts.format == "mxfp4":
            return self._w4a16(x, weights, ids, views, activation, situ_betas)
        return base(x, weights, ids, views["w1"], views["w3"], views["w2"], activation, situ_betas)
