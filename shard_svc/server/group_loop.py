"""The shard server's engine loop on rank 0 of a shard group.

Differences from EngineLoop: while idle it sends heartbeats (pending cancels reach the followers, and a follower
waiting for a step never mistakes an idle server for a dead rank 0); each step it records every follower's pass
times under that follower's rank label; a GroupError (or any failure inside a step) is fatal: every live request
finishes with the error and its exact usage so far, new submits are refused, and the fatal hooks run (the server
reports NOT_SERVING and exits non-zero, so the router takes the shard out of rotation).

Metrics: pass histograms (seconds; for prefill also sequences, tokens, chunks, max chunk tokens) come from every
rank (rank label = the rank that ran and timed its own pass; a group's wall time is the max over ranks). Token
counts, finishes, per-request timings and occupancy are group facts owned by rank 0 (the only rank that owns
sequences) and carry rank="0"; a follower does not repeat them, so `sum by (shard)` stays a count of the group's
tokens. Each follower logs its own prefill pass lines (shard_svc/parallel/worker.py).
"""

from __future__ import annotations

import logging
import time

from shard_svc.parallel.launch import GroupLeader
from shard_svc.server.engine_loop import EngineLoop
from shard_svc.server.metrics import ShardMetrics

log = logging.getLogger(__name__)


class GroupEngineLoop(EngineLoop):
    def __init__(self, leader: GroupLeader, metrics: ShardMetrics, heartbeat_s: float | None = None):
        super().__init__(leader.engine, metrics)
        self.leader = leader
        self.heartbeat_s = heartbeat_s or max(0.5, min(5.0, leader.opts.group_timeout_s / 4))
        self._last_sent = time.monotonic()
        leader.watchdog.on_lost.append(self._rank_lost)

    def _rank_lost(self, what: str) -> None:
        """Watchdog thread: a worker process is gone. Report it at once; the engine thread fails the requests when
        its next collective breaks (at once on gloo, after the timeout on a hung NCCL collective)."""
        if self.failure is None:
            self.failure = f"shard group failed: {what}"
        for hook in self.fatal_hooks:
            hook(self.failure)

    def close_group(self) -> None:
        """After stop(): the stop message to the followers (or, after a failure, killing them)."""
        self.leader.shutdown(failed=self.failure is not None)

    def _wait_for_work(self) -> None:
        idle = time.monotonic() - self._last_sent
        if idle >= self.heartbeat_s:
            self.engine.sync.heartbeat()
            self._last_sent = time.monotonic()
        else:
            self._lock.wait(self.heartbeat_s - idle)

    def _step(self):
        result = super()._step()
        self._last_sent = time.monotonic()
        return result

    def _record(self, result) -> None:
        super()._record(result)
        for p in self.engine.sync.peer_passes:
            self.metrics.observe_pass(p, count_tokens=False)
        self.engine.sync.peer_passes = []  # an iteration that only takes requests in runs no step to record
