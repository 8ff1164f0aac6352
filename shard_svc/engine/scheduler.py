"""Continuous-batching scheduler: pure Python; the only tensors it touches are the prefix cache's.

Each step admits waiting sequences while a state slot and their KV promise fit, then plans one prefill pass
(prompt chunks under a token budget, shared between short and long prompts by shard_svc/engine/prefill_share.py,
so decode step time stays bounded and no prompt waits behind a long one) and one decode pass (every sequence
past its prompt). A sequence's KV promise is the blocks for prompt + its decode budget, so an admitted sequence
never runs out of cache mid-decode, while physical blocks are taken only as tokens arrive.

Host KV offload (opt-in: `offload`, from `EngineConfig.host_kv_bytes` / `kimiserve shard --host-kv-gb`): promises may
then exceed the device, backed by a host pool. A sequence is also admitted when its whole prompt fits beside the
running batch's next step and all promises together stay within device blocks + host pages - M (M: the largest
single promise). When a step's new blocks do not fit, whole sequences' MLA pages move to the host, first those the
step does not run, then the most recently admitted, until they fit; those sequences wait, keeping their state slot
(the KDA state is fixed-size per slot and stays on the device). Offloaded sequences come back, oldest first, as soon
as their pages and next step fit beside the running batch's, and nothing new is admitted while any waits.
Why the host always has room: every sequence holds at most its promise, so a step that does not fit means the
promises exceed device + the pages already on the host; with all promises within device + host - M, more than M
host pages are then free, and no sequence holds more than M.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from shard_svc.engine.prefill_share import PrefillShare
from shard_svc.engine.prefix_cache import CachedPrefix, PrefixCache
from shard_svc.engine.prefix_host import HostPrefix
from shard_svc.engine.sequence import Sequence, SeqStatus
from shard_svc.state.allocators import BlockAllocator, SlotAllocator
from shard_svc.state.host_copy import HostCopier

log = logging.getLogger(__name__)


@dataclass
class StepPlan:
    prefill: list[tuple[Sequence, int]]  # (sequence, number of new prompt tokens this pass)
    decode: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class KVOffloader(Protocol):
    """A host pool for whole sequences' KV pages (shard_svc/state/kv_offload.py HostKVOffload)."""

    @property
    def num_pages(self) -> int: ...

    def offload(self, owner: str) -> int: ...

    def restore(self, owner: str) -> int: ...

    def drop(self, owner: str) -> int: ...


class Scheduler:
    def __init__(self, slots: SlotAllocator, blocks: BlockAllocator, max_running: int, share: PrefillShare,
                 offload: KVOffloader | None = None, prefix_cache: PrefixCache | None = None,
                 copier: HostCopier | None = None):
        """copier: restores states imported from another shard (engine/handoff.py); None: none can be."""
        self.slots, self.blocks = slots, blocks
        self.copier = copier
        self.imported_tokens = 0  # running total restored from imported states, for the metric
        self.max_running, self.share = max_running, share
        self.prefill_budget = share.budget
        self.offload = offload
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # every sequence holding a state slot, in admission order
        self.offloaded: dict[str, int] = {}  # request id -> its KV pages on the host; it holds a slot but waits

    def add(self, seq: Sequence, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def _outstanding_promise(self) -> int:
        return sum(self.blocks.extra_blocks_needed(s.request_id, s.max_total_tokens) for s in self.running)

    def _admit(self) -> None:
        if self.offloaded:
            return  # offloaded sequences come back before anything new is admitted
        promised = self._outstanding_promise()
        while self.waiting and len(self.running) < self.max_running:
            if not self.slots.num_free and not (self.prefix_cache is not None and self.prefix_cache.evict_one()):
                break  # cached prefixes give their state slots back to running sequences
            seq = self.waiting[0]
            hit = self._lookup(seq) if seq.imported is None else None  # an imported state is the sequence's own
            need = self._need(seq, hit)
            while need > self.blocks.num_free - promised and self.prefix_cache is not None and \
                    self.prefix_cache.evict_one():  # cached prefixes give way to admissions, least valuable first
                if hit is not None and not self.prefix_cache.holds(hit):  # evicted: to the host tier, or gone
                    hit = self._lookup(seq)
                need = self._need(seq, hit)
            if need > self.blocks.num_free - promised and not self._fits_with_host(seq):
                break  # FIFO: a large request is not overtaken forever by small ones
            self.waiting.popleft()
            seq.slot = self.slots.allocate(seq.request_id)
            seq.status = SeqStatus.RUNNING
            seq.admitted_at = seq.admitted_at or time.monotonic()
            if seq.imported is not None:
                self._restore_imported(seq)
            elif self.prefix_cache is not None:
                self._restore_prefix(seq, hit)
            promised += need
            self.running.append(seq)

    def _need(self, seq: Sequence, hit: CachedPrefix | HostPrefix | None) -> int:
        """New blocks the sequence's whole promise takes: a cached prefix's full blocks are shared, not taken."""
        shared = self.prefix_cache.shared_blocks(hit) if hit is not None else 0
        return self.blocks.blocks_for(seq.max_total_tokens) - shared

    def _lookup(self, seq: Sequence) -> CachedPrefix | HostPrefix | None:
        """A scored prompt (prompt_logprobs) needs logits at every position and a cached prefix has none: it is
        prefilled whole (its own snapshots are still taken)."""
        if self.prefix_cache is None or seq.params.prompt_logprobs is not None:
            return None
        return self.prefix_cache.lookup(seq.prompt, seq.prefix.salt)

    def _restore_prefix(self, seq: Sequence, hit: CachedPrefix | HostPrefix | None) -> None:
        self.prefix_cache.count_query(len(seq.prompt), hit.length if hit is not None else 0)
        if hit is None:
            return
        logits = self.prefix_cache.restore(hit, seq.request_id, seq.slot)
        seq.num_computed = seq.cached_tokens = hit.length
        if hit.length == len(seq.prompt):
            seq.cached_logits = logits  # the whole prompt is cached: its first token needs no pass
        log.info("prefix restored", extra={"request_id": seq.request_id, "cached_tokens": hit.length,
                                           "prompt_tokens": len(seq.prompt),
                                           "tier": "host" if isinstance(hit, HostPrefix) else "device"})

    def _restore_imported(self, seq: Sequence) -> None:
        """The state another shard handed over, copied into the sequence's fresh slot and blocks of its own; the host
        copy is let go."""
        state, seq.imported = seq.imported, None
        if self.copier is None:
            raise RuntimeError(f"request {seq.request_id!r} carries an imported state but the scheduler has no copier")
        self.copier.load(state.host, seq.request_id, seq.slot, len(state.tokens))
        seq.num_computed = seq.imported_tokens = len(state.tokens)
        self.imported_tokens += len(state.tokens)
        log.info("imported state restored", extra={"request_id": seq.request_id, "imported_tokens": len(state.tokens),
                                                   "prompt_tokens": len(seq.prompt)})

    def _fits_with_host(self, seq: Sequence) -> bool:
        """Past the device's promise (host KV offload only): the bound that keeps room on the host for any
        offload (module docstring), and the whole prompt beside the running batch's next step."""
        if self.offload is None:
            return False
        promises = [self.blocks.blocks_for(s.max_total_tokens) for s in [*self.running, seq]]
        device = self.blocks.num_free + sum(len(self.blocks.table(s.request_id)) for s in self.running)
        if sum(promises) > device + self.offload.num_pages - max(promises):
            return False
        step = sum(self._step_blocks(s) for s in self.running)
        return self.blocks.blocks_for(len(seq.prompt)) <= self.blocks.num_free - step

    def _step_blocks(self, seq: Sequence) -> int:
        """New device blocks `seq` takes in its next step, its prefill chunk counted at the largest it can be (all
        of them, its pages included, for an offloaded sequence: it holds no device block)."""
        n = min(len(seq.prompt) - seq.num_computed, self.prefill_budget) if seq.is_prefilling else 1
        return self.blocks.extra_blocks_needed(seq.request_id, seq.num_computed + n)

    def _restore(self) -> None:
        """Offloaded sequences back to the device, oldest first, while each fits beside the running batch's next
        step (with that headroom the step they come back for never has to offload them again)."""
        waiting = [s for s in self.running if s.request_id in self.offloaded]
        step = sum(self._step_blocks(s) for s in self.running if s.request_id not in self.offloaded)
        for seq in waiting:
            need = self._step_blocks(seq)
            if not self._evict_cached_until(step + need):
                return
            pages = self.offload.restore(seq.request_id)
            del self.offloaded[seq.request_id]
            step += need
            log.info("KV restored from host", extra={"request_id": seq.request_id, "pages": pages,
                                                     "free_blocks": self.blocks.num_free})

    def schedule(self) -> StepPlan:
        if self.offload is not None:
            self._restore()
        self._admit()
        resident = [s for s in self.running if s.request_id not in self.offloaded]
        decode = [s for s in resident if not s.is_prefilling]
        prefilling = [s for s in resident if s.is_prefilling]
        plan = StepPlan(self.share.plan(prefilling, bool(decode)), decode)
        if plan.prefill and self.share.folds_decodes(prefilling):
            # whole prompts restored from the cache draw their first token from the cached row, in no pass
            plan.prefill += [(s, 1) for s in decode if s.cached_logits is None]
            plan.decode = [s for s in decode if s.cached_logits is not None]
        if self.offload is not None:
            self._fit(plan)
        return plan

    def _fit(self, plan: StepPlan) -> None:
        """Offloads whole sequences until the new blocks of the step fit on the device; they wait, off the plan."""
        need = {s.request_id: self.blocks.extra_blocks_needed(s.request_id, s.num_computed + n)
                for s, n in plan.prefill}
        need.update((s.request_id, self.blocks.extra_blocks_needed(s.request_id, s.num_computed + 1))
                    for s in plan.decode)
        if self._evict_cached_until(sum(need.values())):
            return
        resident = [s for s in reversed(self.running) if s.request_id not in self.offloaded]  # newest first
        for seq in sorted(resident, key=lambda s: s.request_id in need):  # those off this step first
            if sum(need.values()) <= self.blocks.num_free or list(need) == [seq.request_id]:
                break  # it fits; or one sequence is left, and one alone always fits (its promise fits the device)
            if self.blocks.table(seq.request_id):
                self.offloaded[seq.request_id] = pages = self.offload.offload(seq.request_id)
                log.info("KV offloaded to host", extra={"request_id": seq.request_id, "pages": pages,
                                                        "free_blocks": self.blocks.num_free})
            need.pop(seq.request_id, None)  # offloaded, or no KV yet: it sits this step out either way
        plan.prefill = [(s, n) for s, n in plan.prefill if s.request_id in need]
        plan.decode = [s for s in plan.decode if s.request_id in need]

    def _evict_cached_until(self, blocks: int) -> bool:
        """Whether `blocks` are free, after evicting cached prefixes (least recent first) as far as that helps:
        the cache's blocks are spare capacity, never a reason to offload or hold back a running sequence."""
        while blocks > self.blocks.num_free:
            if self.prefix_cache is None or not self.prefix_cache.evict_one():
                return False
        return True

    def finish(self, seq: Sequence, last_logits: torch.Tensor | None = None) -> None:
        """Return the sequence's slot and blocks (or host pages) at once; it is never scheduled again.

        With the prefix cache and `last_logits` (the row its last token was sampled from: a normal finish), the
        computed tokens become a cache entry that keeps the slot and shares the blocks."""
        if seq in self.running:
            self.running.remove(seq)
            adopted = (last_logits is not None and self.prefix_cache is not None and seq.num_computed > 0
                       and seq.request_id not in self.offloaded
                       and self.prefix_cache.adopt(seq.tokens[:seq.num_computed], seq.slot, seq.request_id,
                                                   last_logits, seq.prefix.salt))
            if not adopted:
                self.slots.free(seq.slot)
            self.blocks.release(seq.request_id)
            if self.offloaded.pop(seq.request_id, None) is not None:
                self.offload.drop(seq.request_id)
            seq.slot = None
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def queued_tokens(self) -> int:
        return sum(len(s.prompt) for s in self.waiting) + sum(
            len(s.prompt) - s.num_computed for s in self.running if s.is_prefilling)
