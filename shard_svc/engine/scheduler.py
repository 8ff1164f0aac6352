"""Continuous-batching scheduler: pure Python, no tensors.

Each step admits waiting sequences while a state slot and their KV promise fit, then plans one prefill pass
(prompt chunks under a token budget, so decode step time stays bounded) and one decode pass (every sequence
past its prompt). A sequence's KV promise is the blocks for prompt + its decode budget, so an admitted sequence
never runs out of cache mid-decode, while physical blocks are taken only as tokens arrive.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shard_svc.engine.sequence import Sequence, SeqStatus
from shard_svc.state.allocators import BlockAllocator, SlotAllocator


@dataclass
class StepPlan:
    prefill: list[tuple[Sequence, int]]  # (sequence, number of new prompt tokens this pass)
    decode: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    def __init__(self, slots: SlotAllocator, blocks: BlockAllocator, max_running: int, prefill_budget: int):
        self.slots, self.blocks = slots, blocks
        self.max_running, self.prefill_budget = max_running, prefill_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def _outstanding_promise(self) -> int:
        return sum(self.blocks.extra_blocks_needed(s.request_id, s.max_total_tokens) for s in self.running)

    def _admit(self) -> None:
        promised = self._outstanding_promise()
        while self.waiting and len(self.running) < self.max_running and self.slots.num_free:
            seq = self.waiting[0]
            need = self.blocks.blocks_for(seq.max_total_tokens)
            if need > self.blocks.num_free - promised:
                break  # FIFO: a large request is not overtaken forever by small ones
            self.waiting.popleft()
            seq.slot = self.slots.allocate(seq.request_id)
            seq.status = SeqStatus.RUNNING
            promised += need
            self.running.append(seq)

    def schedule(self) -> StepPlan:
        self._admit()
        budget = self.prefill_budget
        prefill: list[tuple[Sequence, int]] = []
        decode: list[Sequence] = []
        for seq in self.running:
            if seq.is_prefilling:
                if budget > 0:
                    n = min(len(seq.prompt) - seq.num_computed, budget)
                    prefill.append((seq, n))
                    budget -= n
            else:
                decode.append(seq)
        return StepPlan(prefill, decode)

    def finish(self, seq: Sequence) -> None:
        """Return the sequence's slot and blocks at once; it is never scheduled again."""
        if seq in self.running:
            self.running.remove(seq)
            self.slots.free(seq.slot)
            self.blocks.release(seq.request_id)
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
