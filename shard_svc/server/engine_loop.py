"""Runs the engine on its own thread and routes every event to the queue of the request id it belongs to.

Callers (gRPC handlers) submit and cancel under the engine lock; the loop steps while there is work. A step is
bounded by the prefill token budget, so a submit waits at most one step for the lock.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

from shard_svc.engine.engine import Engine, StepResult, TokenEvent
from shard_svc.engine.sampling import SamplingParams
from shard_svc.server.metrics import ShardMetrics

log = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """The shard is draining and takes no new sequences."""


@dataclass(frozen=True)
class LoadSnapshot:
    queued_tokens: int
    running: int
    queued: int
    free_slots: int
    free_blocks: int
    total_slots: int
    total_blocks: int


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ShardMetrics):
        self.engine, self.metrics = engine, metrics
        self._lock = threading.Condition()
        self._sinks: dict[str, Callable[[TokenEvent], None]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        with self._lock:
            self._take_snapshot()
        self._publish_occupancy()
        self._thread.start()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
               sink: Callable[[TokenEvent], None]) -> None:
        """Queues a sequence whose events go to `sink` (called on the engine thread; must not block).

        Raises the engine's named errors (InvalidRequest, ContextTooLong, ...) at once, or ShuttingDown."""
        with self._lock:
            if self._stopping:
                raise ShuttingDown(f"shard is draining; request {request_id!r} refused")
            self.engine.add_request(request_id, prompt, params)
            self._sinks[request_id] = sink
            self._take_snapshot()
            self._lock.notify()

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            event = self.engine.cancel(request_id)
            if event is not None:
                self._route(event)
            self._take_snapshot()
            return event is not None

    def load(self) -> LoadSnapshot:
        """The scheduler as of the last step, submit or cancel. Never waits for a step: Load and health probes
        must answer while a long prefill pass runs."""
        return self._snapshot

    def _take_snapshot(self) -> None:
        """Called with the engine lock held."""
        s = self.engine.scheduler
        self._snapshot = LoadSnapshot(s.queued_tokens, len(s.running), s.num_waiting, s.slots.num_free,
                                      s.blocks.num_free, s.slots.num_slots, s.blocks.num_blocks)

    def stop(self, timeout: float | None = None) -> None:
        """Refuses new work, lets in-flight sequences finish (drain), then stops the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self.engine.has_work() and not self._stopping:
                    self._lock.wait()
                if self._stopping and not self.engine.has_work():
                    return
                result = self.engine.step()
                for event in result.events:
                    self._route(event)
                self._take_snapshot()
            self._record(result)

    def _route(self, event: TokenEvent) -> None:
        sink = self._sinks.get(event.request_id)
        if sink is None:
            log.error("event for unknown request id", extra={"request_id": event.request_id})
            return
        sink(event)
        if event.finish_reason is not None:
            del self._sinks[event.request_id]
            self.metrics.sequence_finished(event.finish_reason)

    def _record(self, result: StepResult) -> None:
        for p in result.passes:
            self.metrics.observe_pass(p.kind, p.seconds, p.tokens)
            if p.kind == "prefill":
                log.info("prefill pass", extra={"seconds": round(p.seconds, 6), "sequences": p.sequences,
                                                "tokens": p.tokens, "request_ids": p.request_ids})
        self._publish_occupancy()

    def _publish_occupancy(self) -> None:
        load = self.load()
        self.metrics.set_occupancy(load.running, load.queued, load.total_slots - load.free_slots,
                                   load.total_slots, load.total_blocks - load.free_blocks, load.total_blocks)
