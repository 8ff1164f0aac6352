"""Measuring what the device has left once the weights are placed: the inputs of `capacity.plan_from_memory`.

A probe engine with small pools runs a full-budget prefill pass and a decode pass at the largest batch the budget
could hold (sampling with top-k / top-p included), then captures the decode graphs at that batch; the allocator's
peak above the probe's pools is the activation peak, the free memory the capture took is the graphs' share. The
probe is then dropped and what is in use measured again, so anything it left behind counts as used, never as free.

A pass late in a long prompt also holds its attention's context workspace: the MLA prefill expands the latents of
the keys it reads to per-head keys and values, at most `ops.mla_prefill.context_workspace_tokens` of them at once,
and from `long_context_pairs` (new tokens x cached ones) it hands a sequence to a library whose workspace differs.
The probe's prompt is long enough that its last full-budget pass is past both (`attention_peak_context`), so the
largest workspace is in the peak; an op that declares no bound (the eager reference) is profiled at no context.

The meter is the seam: `CudaMeter` reads torch.cuda; a CPU test passes its own to run the same probe on the CPU.
"""

from __future__ import annotations

import gc
import logging
import math
from typing import Callable, Protocol

import torch

from shard_svc.engine.capacity import (
    MAX_AUTO_STATE_SLOTS, CapacityRequest, MemoryReport, UnitSizes, gpu_prefill_budget, plan_from_memory)
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.errors import KimiServeError
from shard_svc.ops import Ops

log = logging.getLogger(__name__)


class MemoryProbeFailed(KimiServeError):
    """A pass of the memory probe failed, so the activation peak it would measure is unknown."""


class MemoryMeter(Protocol):
    device: str

    def total_and_free(self) -> tuple[int, int]: ...

    def allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int: ...

    def release(self) -> None:
        """Give cached, unused memory back to the device (after the probe is dropped)."""


class CudaMeter:
    def __init__(self, device: torch.device):
        self.dev = device
        self.device = str(device)

    def total_and_free(self) -> tuple[int, int]:
        torch.cuda.synchronize(self.dev)
        free, total = torch.cuda.mem_get_info(self.dev)
        return total, free

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.dev)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.dev)
        torch.cuda.reset_peak_memory_stats(self.dev)

    def peak(self) -> int:
        torch.cuda.synchronize(self.dev)
        return torch.cuda.max_memory_allocated(self.dev)

    def release(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.dev)
        torch.cuda.empty_cache()


def attention_peak_context(ops: Ops, budget: int) -> int:
    """The context from which a prefill pass of `budget` tokens holds the attention's largest workspace: the keys it
    expands at once, or the context that sends a full pass to its library, whichever is later (0: no bound)."""
    workspace = int(getattr(ops.mla_prefill, "context_workspace_tokens", 0))
    pairs = int(getattr(ops.mla_prefill, "long_context_pairs", 0))
    return max(workspace, -(-pairs // max(budget, 1))) if workspace else 0


def probe_batch(request: CapacityRequest, sizes: UnitSizes, meter: MemoryMeter, model_max_len: int) -> int:
    """The decode batch to profile: the operator's slot count, else the most a budget without activations holds.
    Flags that cannot fit even without activations are refused here, before the probe allocates anything."""
    total, free = meter.total_and_free()
    plan = plan_from_memory(request, sizes, MemoryReport(meter.device, total, total - free, 0), model_max_len)
    return min(MAX_AUTO_STATE_SLOTS, plan.num_state_slots) if request.num_state_slots is None else plan.num_state_slots


def measure(build: Callable[[EngineConfig], Engine], request: CapacityRequest, sizes: UnitSizes,
            meter: MemoryMeter, model_max_len: int, capture_graphs: Callable[[Engine], object] | None,
            peak_context: Callable[[int], int] | None = None) -> MemoryReport:
    """Runs the probe (module docstring) on engines from `build` and returns the report to size from.
    capture_graphs: what the served engine will capture (None: decode stays eager). peak_context: the served ops'
    `attention_peak_context` for a prefill budget (None: no context)."""
    prefill = min(gpu_prefill_budget(request), model_max_len - 1)
    batch = probe_batch(request, sizes, meter, model_max_len)
    bs = sizes.kv_block_size
    per_pass = max(prefill, batch)
    # Whole passes of context before the last one, so that it is a full-budget pass reading the whole workspace,
    # as far as the model's length allows.
    wanted = peak_context(prefill) if peak_context is not None else 0
    context = min(math.ceil(wanted / per_pass), (model_max_len - 1 - prefill) // per_pass) * per_pass
    prompt = prefill + context
    # Room for the prefill sequence, then for every decode sequence (3 tokens: one block each). `build` adds the
    # decode graphs' padding slot and block where graphs run.
    probe_cfg = EngineConfig(num_state_slots=batch, num_kv_blocks=max(math.ceil((prompt + 1) / bs), batch),
                             kv_block_size=bs, prefill_token_budget=per_pass)
    engine = build(probe_cfg)
    meter.reset_peak()
    base = meter.allocated()
    probes = [engine.generate([(7 * i) % 97 + 1 for i in range(prompt)],
                              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                              request_id="memory-probe-prefill")]
    sampled = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=2, seed=0, logprobs=True,
                             top_logprobs=5, ignore_eos=True)
    for i in range(batch):  # one packed prefill of 1-token prompts, then one decode pass of them all
        probes.append(engine.add_request(f"memory-probe-decode-{i}", [i % 97 + 1], sampled))
    while engine.has_work():
        engine.step()
    # A failed pass is logged and its sequences finish with an error; a peak without that pass would undersize.
    failed = [s for s in probes if s.finish_reason == "error"]
    if failed:
        raise MemoryProbeFailed(f"the memory probe's {failed[0].request_id} ({len(failed[0].prompt)} prompt tokens, "
                                f"{len(failed)} of {len(probes)} probe requests failed) on {meter.device}: "
                                f"{failed[0].error}; capacity cannot be measured")
    activation = max(0, meter.peak() - base)
    graph = 0
    if capture_graphs is not None:
        meter.release()
        _, before = meter.total_and_free()
        capture_graphs(engine)
        _, after = meter.total_and_free()
        graph = max(0, before - after)
    del engine
    meter.release()
    total, free = meter.total_and_free()
    report = MemoryReport(meter.device, total, total - free, activation, graph)
    log.info("memory profiled", extra={"device": meter.device, "prefill_tokens": prefill,
                                       "prefill_context_tokens": context, "decode_batch": batch,
                                       "total_bytes": total, "in_use_bytes": total - free,
                                       "activation_peak_bytes": activation, "graph_bytes": graph})
    return report
