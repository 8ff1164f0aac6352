"""The capacity an engine is built with, once its weights are placed: the operator's flags, and for every unset
one either a size from the device's memory (one process on a GPU) or the fixed defaults (the CPU, a shard group).

`capacity.py` is the arithmetic, `memory_profile.py` the measurement; this module decides which applies and logs
the outcome in one line ("capacity chosen").
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from shard_svc.config import ModelConfig
from shard_svc.engine.capacity import (
    CapacityRequest, UnitSizes, cpu_plan, plan_from_memory, plan_host_kv)
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.memory_profile import CudaMeter, MemoryMeter, measure
from shard_svc.host_memory import host_available_bytes
from shard_svc.state.kv_offload import HostKVProfile

log = logging.getLogger(__name__)


def sized_config(request: CapacityRequest, base: EngineConfig, cfg: ModelConfig, device: torch.device,
                 dtype: torch.dtype, build: Callable[[EngineConfig], Engine],
                 capture_graphs: Callable[[Engine], object] | None, in_group: bool,
                 meter: MemoryMeter | None = None, peak_context: Callable[[int], int] | None = None
                 ) -> EngineConfig:
    """`base` with the request's capacity filled in. base supplies what is not sized here (the prefix state interval
    and host entries). build: an engine of the served kind for a config (the memory probe's);
    capture_graphs: what the served engine captures (None: eager). meter: CudaMeter on a GPU unless given.
    peak_context: the served ops' `memory_profile.attention_peak_context` for a budget, profiled by the probe."""
    measured = meter is not None or (device.type == "cuda" and not in_group)
    block = request.block_size(measured)
    host_kv_bytes, host_why = 0, "host KV offload off"
    if request.host_kv_bytes != 0:
        page = HostKVProfile.from_config(cfg).page_bytes(block, dtype)
        host_kv_bytes, host_why = plan_host_kv(request.host_kv_bytes, host_available_bytes(), page)
    model_max = cfg.max_position_embeddings
    if not measured:
        reason = "shard group: every rank must size alike" if in_group else f"device {device} is not measured"
        plan = cpu_plan(request, block, model_max, reason)
    else:
        sizes = UnitSizes.for_model(cfg, dtype, block)
        report = measure(build, request, sizes, meter or CudaMeter(device), model_max, capture_graphs,
                         peak_context)
        plan = plan_from_memory(request, sizes, report, model_max, host_kv=host_kv_bytes > 0)
    log.info("capacity chosen", extra={"device": str(device), "state_slots": plan.num_state_slots,
                                       "kv_blocks": plan.num_kv_blocks, "kv_block_size": block,
                                       "prefix_cache_entries": plan.prefix_cache_entries,
                                       "prefill_token_budget": plan.prefill_token_budget,
                                       "max_model_len": plan.max_model_len, "host_kv_bytes": host_kv_bytes,
                                       "why": f"{plan.why}; {host_why}"})
    return dataclasses.replace(base, num_state_slots=plan.num_state_slots, num_kv_blocks=plan.num_kv_blocks,
                               kv_block_size=block,
                               prefill_token_budget=plan.prefill_token_budget, max_model_len=request.max_model_len,
                               host_kv_bytes=host_kv_bytes, prefix_cache_entries=plan.prefix_cache_entries)
