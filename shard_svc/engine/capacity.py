"""Shard capacity from memory: a memory report in, state slots / KV blocks / prefix-cache entries out.

Pure arithmetic (no device, no torch allocation), so every rule is tested on the CPU with made-up reports. The
device side (placing the weights, profiling a full-budget prefill pass and the largest decode batch, measuring the
decode graphs) is `shard_svc/engine/memory_profile.py`; docs/design.md#capacity-from-memory states the split.

Budget = `--gpu-memory-utilization` x the device's total - what is in use once the weights are placed (every
process and the CUDA context included) - the profiled activation peak - the decode graphs' memory. Of the budget:

- KDA state (running sequences' slots and prefix-cache entries) takes at most STATE_SHARE (half; three quarters with
  host KV offload on, whose host pool takes KV the device cannot hold), at most MAX_AUTO_STATE_SLOTS running slots,
  with one prefix-cache entry for every ENTRY_EVERY running slots, and at least MIN_AUTO_PREFIX_ENTRIES while
  they fit in that share;
- the MLA KV cache takes the rest, in whole blocks.

A flag the operator set is taken as is, and what it uses comes off the budget first. Byte sizes come from the
model's own layer map and widths (`UnitSizes.for_model`), never from another model's figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shard_svc.config import ModelConfig
from shard_svc.errors import CapacityError

GiB = float(1 << 30)
MiB = float(1 << 20)

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
GPU_PREFILL_TOKEN_BUDGET = 8192  # new prompt tokens per prefill pass on a GPU: big passes keep the GPU busy
MAX_AUTO_STATE_SLOTS = 256  # running sequences when sized from memory; a decode step's batch is at most this
STATE_SHARE = 0.5  # most of the budget KDA state may take when sized from memory; KV gets the rest
STATE_SHARE_HOST_KV = 0.75  # with host KV offload, whose pool holds the KV pages the device cannot
ENTRY_EVERY = 4  # one prefix-cache entry per this many running slots, when sized from memory
# One prompt can make several entries (message ends, interval points, its end), so a shard with few slots still
# keeps this many, within the state share: with one entry a prompt's own end evicts the system prompt's point.
MIN_AUTO_PREFIX_ENTRIES = 16
HOST_KV_SHARE = 0.5  # `--host-kv-gb auto`: this share of the host's available memory once the weights are placed

GPU_KV_BLOCK_SIZE = 64  # tokens per KV block on a GPU (the block size the served benchmarks run)
# On the CPU (and in shard groups) nothing is measured: these are the shard's fixed defaults, as before.
CPU_KV_BLOCK_SIZE = 16
CPU_STATE_SLOTS = 16
CPU_KV_BLOCKS = 1024
CPU_PREFILL_TOKEN_BUDGET = 512
CPU_PREFIX_CACHE_ENTRIES = 16


class CapacityDoesNotFit(CapacityError):
    """The device (or host) budget cannot hold what was asked for, or not even one sequence; the message names the
    budget, each part of it and the sizes that do not fit."""


@dataclass(frozen=True)
class MemoryReport:
    """One device's memory once the weights are placed (a streaming shard: its resident part and weight slots)."""

    device: str
    total_bytes: int  # the device's memory
    in_use_bytes: int  # total - free after placing the weights: every process and the CUDA context count
    activation_peak_bytes: int  # most a full-budget prefill pass or the largest decode batch allocated on top
    graph_bytes: int = 0  # the decode CUDA graphs' private memory, at the profiled batch

    def describe(self) -> str:
        return (f"{self.device}: {self.total_bytes / GiB:.2f} GiB total, {self.in_use_bytes / GiB:.2f} GiB in use "
                f"after the weights, activation peak {self.activation_peak_bytes / GiB:.2f} GiB, decode graphs "
                f"{self.graph_bytes / GiB:.2f} GiB")


@dataclass(frozen=True)
class UnitSizes:
    """Bytes of one unit of each pool, from the model's layer map (shard_svc/state/pools.py lays them out)."""

    state_slot_bytes: int  # one KDA state slot: recurrent state (fp32) + conv state of every KDA layer
    counts_row_bytes: int  # one slot's penalty counts (int32 + bool per vocab id), allocated when first used
    logits_row_bytes: int  # one prefix-cache entry's logits row (fp32 per vocab id)
    kv_block_bytes: int  # one KV block: block_size tokens of every MLA layer's latent
    kv_block_size: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, dtype: torch.dtype, kv_block_size: int,
                  kda_heads: int | None = None) -> "UnitSizes":
        """dtype: the model's (KV cache and conv state); kda_heads: a shard-group rank's heads (None: all)."""
        k, layers = cfg.kda, cfg.layer_map
        heads = k.num_heads if kda_heads is None else kda_heads
        recurrent = heads * k.head_dim * k.head_dim * torch.promote_types(dtype, torch.float32).itemsize
        conv = 3 * heads * k.head_dim * (k.conv_kernel - 1) * dtype.itemsize
        return cls(state_slot_bytes=layers.num_kda * (recurrent + conv),
                   counts_row_bytes=cfg.vocab_size * (torch.int32.itemsize + torch.bool.itemsize),
                   logits_row_bytes=cfg.vocab_size * torch.float32.itemsize,
                   kv_block_bytes=layers.num_mla * kv_block_size * cfg.mla.latent_dim * dtype.itemsize,
                   kv_block_size=kv_block_size)

    @property
    def running_slot_bytes(self) -> int:
        return self.state_slot_bytes + self.counts_row_bytes

    @property
    def entry_bytes(self) -> int:
        """A prefix-cache entry: its own state slot (with a counts row: counts are kept per pool slot) and logits."""
        return self.state_slot_bytes + self.counts_row_bytes + self.logits_row_bytes


@dataclass(frozen=True)
class CapacityRequest:
    """The operator's capacity flags; None: chosen here (from memory on a GPU, the CPU defaults elsewhere)."""

    num_state_slots: int | None = None
    num_kv_blocks: int | None = None
    prefix_cache_entries: int | None = None
    prefill_token_budget: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    host_kv_bytes: int | None = 0  # --host-kv-gb: 0 off, None `auto` (plan_host_kv)
    kv_block_size: int | None = None

    def block_size(self, measured: bool) -> int:
        """--kv-block-size, else GPU_KV_BLOCK_SIZE where capacity is sized from memory, CPU_KV_BLOCK_SIZE elsewhere."""
        if self.kv_block_size is not None:
            return self.kv_block_size
        return GPU_KV_BLOCK_SIZE if measured else CPU_KV_BLOCK_SIZE

    def check(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise CapacityDoesNotFit(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name, value, low in (("--num-state-slots", self.num_state_slots, 1),
                                 ("--num-kv-blocks", self.num_kv_blocks, 1),
                                 ("--prefix-cache-entries", self.prefix_cache_entries, 0),
                                 ("--prefill-token-budget", self.prefill_token_budget, 1),
                                 ("--max-model-len", self.max_model_len, 1),
                                 ("--kv-block-size", self.kv_block_size, 1)):
            if value is not None and value < low:
                raise CapacityDoesNotFit(f"{name} must be at least {low}, got {value}")


@dataclass(frozen=True)
class CapacityPlan:
    num_state_slots: int
    num_kv_blocks: int
    prefix_cache_entries: int
    prefill_token_budget: int
    max_model_len: int  # what one sequence can hold: the model's context, --max-model-len and the KV cache
    why: str  # one line: where each number came from


def cpu_plan(request: CapacityRequest, kv_block_size: int, model_max_len: int, reason: str) -> CapacityPlan:
    """The fixed defaults for every unset flag (no memory measured: the CPU, or a shard group)."""
    request.check()
    slots = _given(request.num_state_slots, CPU_STATE_SLOTS)
    blocks = _given(request.num_kv_blocks, CPU_KV_BLOCKS)
    entries = _given(request.prefix_cache_entries, CPU_PREFIX_CACHE_ENTRIES)
    budget = _given(request.prefill_token_budget, CPU_PREFILL_TOKEN_BUDGET)
    max_len = _max_len(request.max_model_len, model_max_len, blocks * kv_block_size)
    summary = _summary(request, slots, blocks, entries, budget, max_len, "default")
    return CapacityPlan(slots, blocks, entries, budget, max_len, f"fixed defaults ({reason}): {summary}")


def gpu_prefill_budget(request: CapacityRequest) -> int:
    """The prefill budget to profile and serve with on a GPU."""
    return _given(request.prefill_token_budget, GPU_PREFILL_TOKEN_BUDGET)


def plan_from_memory(request: CapacityRequest, sizes: UnitSizes, report: MemoryReport, model_max_len: int,
                     host_kv: bool = False) -> CapacityPlan:
    """Sizes every unset flag from `report` (module docstring); raises CapacityDoesNotFit naming the sizes when the
    flags given, or one sequence, do not fit the budget."""
    request.check()
    util = request.gpu_memory_utilization
    budget = (int(util * report.total_bytes) - report.in_use_bytes - report.activation_peak_bytes
              - report.graph_bytes)
    budget_text = (f"budget {budget / GiB:.2f} GiB = {util:g} x {report.total_bytes / GiB:.2f} GiB - "
                   f"{report.in_use_bytes / GiB:.2f} GiB in use after the weights - "
                   f"{report.activation_peak_bytes / GiB:.2f} GiB activation peak - "
                   f"{report.graph_bytes / GiB:.2f} GiB decode graphs on {report.device}")
    prefill = gpu_prefill_budget(request)
    # One sequence must fit: a running slot and the KV of --max-model-len tokens (when set) or one full prefill pass.
    one_len = request.max_model_len or min(model_max_len, prefill)
    one_blocks = math.ceil(one_len / sizes.kv_block_size)
    one_seq = sizes.running_slot_bytes + one_blocks * sizes.kv_block_bytes
    if budget < one_seq:
        raise CapacityDoesNotFit(
            f"not even one sequence fits: it needs one KDA state slot ({_mib(sizes.running_slot_bytes)}) and "
            f"{one_blocks} KV blocks of {sizes.kv_block_size} tokens ({one_len} tokens x "
            f"{sizes.kv_block_bytes / sizes.kv_block_size:.0f} B = {_mib(one_blocks * sizes.kv_block_bytes)}), "
            f"{_mib(one_seq)} in all; {budget_text}. Raise --gpu-memory-utilization, lower --max-model-len or "
            "--prefill-token-budget, or stream weights (--weights stream)")
    slots, entries, blocks = request.num_state_slots, request.prefix_cache_entries, request.num_kv_blocks
    fixed = ((slots or 0) * sizes.running_slot_bytes + (entries or 0) * sizes.entry_bytes
             + (blocks or 0) * sizes.kv_block_bytes)
    if fixed > budget:
        raise CapacityDoesNotFit(
            f"the capacity flags need {_gib(fixed)} (--num-state-slots {slots} x {_mib(sizes.running_slot_bytes)}, "
            f"--prefix-cache-entries {entries} x {_mib(sizes.entry_bytes)}, --num-kv-blocks {blocks} x "
            f"{_mib(sizes.kv_block_bytes)}; unset ones count 0), over the {budget_text}. Lower them or raise "
            "--gpu-memory-utilization")
    share = STATE_SHARE_HOST_KV if host_kv else STATE_SHARE
    # What state may take: its share of the budget, or everything explicit KV blocks leave.
    state_room = budget - blocks * sizes.kv_block_bytes if blocks is not None else int(share * budget)
    state_room -= (slots or 0) * sizes.running_slot_bytes + (entries or 0) * sizes.entry_bytes
    if slots is None:
        per = sizes.running_slot_bytes + (sizes.entry_bytes / ENTRY_EVERY if entries is None else 0)
        slots = max(1, min(MAX_AUTO_STATE_SLOTS, int(max(state_room, 0) // per)))
    if entries is None:
        floor_room = state_room - (slots * sizes.running_slot_bytes if request.num_state_slots is None else 0)
        floor = min(MIN_AUTO_PREFIX_ENTRIES, max(0, int(floor_room // sizes.entry_bytes)))
        entries = min(max(math.ceil(slots / ENTRY_EVERY), floor),
                      max(0, int((budget - slots * sizes.running_slot_bytes - one_blocks * sizes.kv_block_bytes)
                                 // sizes.entry_bytes)))
    state = slots * sizes.running_slot_bytes + entries * sizes.entry_bytes
    if blocks is None:
        blocks = int((budget - state) // sizes.kv_block_bytes)
    kv = blocks * sizes.kv_block_bytes
    if state + kv > budget or blocks * sizes.kv_block_size < one_len:
        raise CapacityDoesNotFit(
            f"{slots} state slots ({_gib(slots * sizes.running_slot_bytes)}) and {entries} prefix-cache entries "
            f"({_gib(entries * sizes.entry_bytes)}) leave room for {blocks} KV blocks ({blocks * sizes.kv_block_size} "
            f"tokens), and one sequence of {one_len} tokens needs {one_blocks}; {budget_text}. Lower "
            "--num-state-slots / --prefix-cache-entries or --max-model-len")
    max_len = _max_len(request.max_model_len, model_max_len, blocks * sizes.kv_block_size)
    why = (f"from memory: {_summary(request, slots, blocks, entries, prefill, max_len, 'sized')}; state "
           f"{_gib(state)} ({_mib(sizes.running_slot_bytes)} a slot, {_mib(sizes.entry_bytes)} an entry), KV "
           f"{_gib(kv)} ({sizes.kv_block_bytes} B a block of {sizes.kv_block_size} tokens); {budget_text}")
    return CapacityPlan(slots, blocks, entries, prefill, max_len, why)


def plan_host_kv(requested_bytes: int | None, available_bytes: int | None, page_bytes: int) -> tuple[int, str]:
    """(host KV pool bytes, why) for `--host-kv-gb`: a number is taken as is (the pool checks it against the host
    when it allocates), `auto` (None here) takes HOST_KV_SHARE of the host's available memory once the weights are
    placed, in whole pages; the host's memory is the budget of the host tier, as the device's is of the device."""
    if requested_bytes is not None:
        return requested_bytes, f"--host-kv-gb {requested_bytes / GiB:.2f}"
    if available_bytes is None:
        raise CapacityDoesNotFit("--host-kv-gb auto: this host reports no available memory (/proc/meminfo has no "
                                 "MemAvailable); pass --host-kv-gb N")
    pages = int(HOST_KV_SHARE * available_bytes) // page_bytes
    if pages < 1:
        raise CapacityDoesNotFit(f"--host-kv-gb auto: {HOST_KV_SHARE:g} of the host's {_gib(available_bytes)} "
                                 f"available holds no KV page of {_mib(page_bytes)}")
    return pages * page_bytes, (f"--host-kv-gb auto: {pages} pages of {_mib(page_bytes)} = "
                                f"{_gib(pages * page_bytes)}, {HOST_KV_SHARE:g} of {_gib(available_bytes)} available "
                                "on the host after the weights")


def _given(value: int | None, default: int) -> int:
    return default if value is None else value


def _max_len(flag: int | None, model_max_len: int, kv_tokens: int) -> int:
    return min(flag or model_max_len, model_max_len, kv_tokens)


def _summary(request: CapacityRequest, slots: int, blocks: int, entries: int, prefill: int, max_len: int,
             unset: str) -> str:
    def src(value: int | None) -> str:
        return "flag" if value is not None else unset

    return (f"{slots} state slots ({src(request.num_state_slots)}), {blocks} KV blocks "
            f"({src(request.num_kv_blocks)}), {entries} prefix-cache entries ({src(request.prefix_cache_entries)}), "
            f"prefill budget {prefill} ({src(request.prefill_token_budget)}), max model len {max_len}")


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / MiB:.2f} MiB"
