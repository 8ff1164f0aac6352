"""The engine's hook on a shard group: one replicated engine per rank, kept in lockstep by rank 0.

Every rank runs the same Engine (sequences, scheduler, allocators; pools sized for its own head slice). Rank 0,
the leader, is the only rank that takes requests: it journals every accepted add and every cancel, and sends the
journal with each step (or idle heartbeat); the followers apply it in the same order, so every rank holds the same
sequences and computes the same schedule. One step, on every rank:
 1. the leader broadcasts StepMessage("step", journal); followers have applied it before stepping;
 2. each rank schedules; the plan digests are all-gathered and compared (GroupDiverged, named, instead of a
    collective deadlocking on mismatched shapes);
 3. the forward passes run the model's collectives;
 4. after each pass the leader samples and broadcasts the tokens (and logprobs), and every rank appends the same
    tokens, so stop tokens and lengths finish the same sequences everywhere;
 5. the sequence-state digests and each rank's pass records (PassRecord: its own wall time, tokens, chunks...)
    are all-gathered and compared. Only then does the step return its events: completion and usage are reported
    after every rank agrees on every sequence's metadata. Rank 0 exports every rank's pass records.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from shard_svc.config import ModelConfig
from shard_svc.engine.sampling import Drawn
from shard_svc.parallel.errors import GroupDiverged
from shard_svc.parallel.group import ShardGroup, digest
from shard_svc.parallel.layout import ParallelLayout
from shard_svc.engine.pass_record import NO_PASS, PassRecord

log = logging.getLogger(__name__)

PASS_KINDS = ("prefill", "decode")


@dataclass(frozen=True)
class StepMessage:
    kind: str  # "step" (then every rank steps) | "idle" (heartbeat: journal only) | "stop" (the group shuts down)
    # ("add", request_id, prompt, SamplingParams, keep_prompt_logits, PrefixHints, prior_output) | ("cancel", id)
    journal: tuple[tuple, ...]


class StepSync:
    """The engine's StepSync (shard_svc/engine/step_sync.py) on a rank of a shard group."""

    def __init__(self, group: ShardGroup, layout: ParallelLayout, cfg: ModelConfig):
        self.group, self.layout = group, layout
        self.leader = group.rank == 0
        self.kda_heads = layout.local_kda_heads(cfg)  # the runner sizes the KDA pool by this
        self.steps = 0
        self.peer_passes: list[PassRecord] = []  # the followers' passes of the last step (leader only), for metrics
        self._journal: list[tuple] = []

    @property
    def world(self) -> int:
        return self.group.world

    # -- leader: requests and messages ---------------------------------------------------------------------------
    def on_add(self, request_id: str, prompt: list[int], params, keep_prompt_logits: bool, prefix,
               prior_output: int) -> None:
        if self.leader:
            self._journal.append(("add", request_id, list(prompt), params, keep_prompt_logits, prefix, prior_output))

    def on_cancel(self, request_id: str) -> None:
        if self.leader:
            self._journal.append(("cancel", request_id))

    def _send(self, kind: str) -> None:
        msg = StepMessage(kind, tuple(self._journal))
        self._journal.clear()
        self.group.broadcast_object(msg, f"sending the {kind} message")

    def begin_step(self) -> None:
        if self.leader:
            self._send("step")

    def heartbeat(self) -> None:
        """Leader, while idle: delivers pending cancels and proves the group alive before the followers time out."""
        self._send("idle")

    def stop(self) -> None:
        self._send("stop")

    # -- followers ------------------------------------------------------------------------------------------------
    def receive(self) -> StepMessage:
        return self.group.broadcast_object(None, "waiting for rank 0's next step")

    def apply(self, engine, msg: StepMessage) -> None:
        for entry in msg.journal:
            if entry[0] == "add":
                _, request_id, prompt, params, keep, prefix, prior_output = entry
                try:
                    engine.add_request(request_id, prompt, params, keep, prefix=prefix, prior_output=prior_output)
                except Exception as e:  # noqa: BLE001 - rank 0 accepted it, so refusing it here is a divergence
                    raise GroupDiverged(f"rank {self.group.rank} refused request {request_id!r} that rank 0 "
                                        f"accepted: {e}") from e
            else:
                engine.cancel(entry[1])

    # -- every rank, inside Engine.step ---------------------------------------------------------------------------
    def check_plan(self, plan) -> None:
        mine = digest(([(s.request_id, n) for s, n in plan.prefill], [s.request_id for s in plan.decode]))
        digests = [row[0] for row in self.group.all_gather_ints([mine], "comparing step plans")]
        if len(set(digests)) != 1:
            raise GroupDiverged(f"step {self.steps}: ranks computed different plans (digest by rank {digests}); "
                                f"rank {self.group.rank} planned prefill "
                                f"{[(s.request_id, n) for s, n in plan.prefill]} decode "
                                f"{[s.request_id for s in plan.decode]}")

    def draw(self, n: int, sample: Callable[[], list[Drawn]]) -> list[Drawn]:
        """The n draws of a pass: `sample()` runs on the leader and its tokens and logprobs are broadcast to every
        rank (only the leader's events are served, so top alternatives stay with it)."""
        if not n:
            return []
        buf = torch.zeros(2, n, dtype=torch.float64)  # [token ids; logprobs], ids exact below 2^53
        drawn = None
        if self.leader:
            drawn = sample()
            buf[0] = torch.tensor([d.token for d in drawn], dtype=torch.float64)
            buf[1] = torch.tensor([d.logprob for d in drawn], dtype=torch.float64)
        self.group.broadcast_tensor(buf, "broadcasting sampled tokens")
        return drawn or [Drawn(int(t), lp) for t, lp in zip(buf[0].tolist(), buf[1].tolist())]

    def end_step(self, engine, result) -> None:
        row = [digest(_state(engine))]
        mine = {p.kind: p for p in result.passes}
        for kind in PASS_KINDS:
            row += (PassRecord.of(mine[kind], self.group.rank, self.group.world).to_ints() if kind in mine
                    else NO_PASS)
        rows = self.group.all_gather_ints(row, "comparing sequence state")
        differ = [r for r, other in enumerate(rows) if other[0] != rows[0][0]]
        if differ:
            raise GroupDiverged(f"step {self.steps}: ranks {differ} hold different sequence state from rank 0 "
                                f"(rank {self.group.rank} holds {_state(engine)})")
        if self.leader:
            width = len(NO_PASS)
            records = (PassRecord.from_ints(kind, rows[r][1 + k * width:1 + (k + 1) * width], r, len(rows))
                       for r in range(1, len(rows)) for k, kind in enumerate(PASS_KINDS))
            self.peer_passes = [p for p in records if p is not None]
        self.steps += 1


def _state(engine) -> tuple:
    """What every rank must agree on after a step: each live sequence's progress (its cached prompt tokens too), the
    queue, the free pools, and the prefix cache's decisions (entries per tier, hits, evictions), each rank holding
    its own shard of every entry's state."""
    seqs = tuple((rid, s.num_computed, len(s.output), s.output[-1] if s.output else -1, s.slot, s.status.value,
                  s.cached_tokens) for rid, s in engine.sequences.items())
    s, cache = engine.scheduler, engine.prefix_cache
    prefix = None if cache is None else (len(cache), cache.host_entries, dataclasses.astuple(cache.stats))
    return seqs, tuple(q.request_id for q in s.waiting), s.slots.num_free, s.blocks.num_free, prefix
