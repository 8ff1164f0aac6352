"""Runs the engine on its own thread and routes every event to the sink of the request id it belongs to.

Only the engine thread touches the engine. gRPC handlers check a request against the engine's fixed sizes at once
(a bad request is refused before it is queued), then hand it over through an intake list and return: a submit
never waits for a step. Requests that arrive while a pass runs are all admitted before the next step, so a burst
of prompts is prefilled together in the passes the prefill token budget allows, not one per pass.

A failure inside a pass fails only that pass's sequences (the engine catches it). Anything that escapes a step
leaves the engine in an unknown state: every live request finishes with an error naming the failure, new submits
are refused, and the fatal hooks run (the server reports NOT_SERVING and exits non-zero).

A drain (`stop(move=True)`, SIGTERM) hands every movable sequence over instead of finishing it here: between two
steps each one's state goes to `exports` and its stream gets a Moved event (shard_svc/engine/handoff.py); states
another shard exported wait in `imports` for their continuation's Submit.

After each step the loop records: every pass (metrics, and one JSON log line per prefill pass), and every request
that finished (per-request metrics, the timing its Finished event carries, and its spans when it is traced).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from kimiserve import tracing
from shard_svc.engine.engine import Engine, StepResult, TokenEvent
from shard_svc.engine.handoff import PackedState, SequenceState, StateStore, StateUnavailable, check_continues
from shard_svc.engine.sampling import SamplingParams
from shard_svc.engine.prefix_cache import PrefixCache
from shard_svc.engine.sequence import PrefixHints, Sequence, SequenceTiming
from shard_svc.errors import DuplicateRequest, KimiServeError
from shard_svc.server import request_trace
from shard_svc.server.metrics import ShardMetrics
from shard_svc.engine.pass_record import PassRecord
from shard_svc.server.request_trace import PrefillPart, TracedRequest

log = logging.getLogger(__name__)


class ShuttingDown(RuntimeError):
    """The shard is draining (or has failed) and takes no new sequences."""


@dataclass(frozen=True)
class LoadSnapshot:
    queued_tokens: int
    running: int
    queued: int
    free_slots: int
    free_blocks: int
    total_slots: int
    total_blocks: int
    prefix_entries: int = 0
    prefix_blocks: int = 0


@dataclass(frozen=True)
class _Submitted:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    matcher: Any  # the compiled response_format, or None
    arrived_at: float  # time.monotonic() when the gRPC handler took it
    traced: TracedRequest | None = None
    prefix: PrefixHints = PrefixHints()
    prior_output: int = 0
    movable: bool = False
    imported: SequenceState | None = None


@dataclass
class _Live:
    """A request the engine holds: its sequence (for its timing) and, when traced, what its spans need."""

    seq: Sequence
    traced: TracedRequest | None


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ShardMetrics):
        self.engine, self.metrics = engine, metrics
        self._lock = threading.Condition()
        self._sinks: dict[str, Callable[[TokenEvent], None]] = {}  # every live request: queued or in the engine
        self._intake: list[_Submitted] = []
        self._cancels: list[str] = []
        self._live: dict[str, _Live] = {}  # engine thread only: every request taken into the engine
        self._finished: list[tuple[_Live, TokenEvent]] = []  # engine thread only: finished since the last record
        self._stopping = False
        self._move_out = False  # a drain asked the loop to hand its movable sequences over, before its next step
        self.failure: str | None = None
        self.fatal_hooks: list[Callable[[str], None]] = []
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # Run on the engine thread before it takes any request (shard_svc/engine/warmup.py warm_request_paths:
        # per-thread library handles and the first request's paths); `ready` is set once it returned or failed.
        self.before_serving: Callable[[Engine], object] | None = None
        self.ready = threading.Event()
        # Sequence states handed over (engine/handoff.py): moved out by a drain, until the router fetches them; and
        # imported from other shards, until their Submit (each will take a state slot, so at most the slots).
        self.exports: StateStore[PackedState] = StateStore("exported states")
        self.imports: StateStore[SequenceState] = StateStore("imported states", engine.scheduler.max_running)

    def start(self) -> None:
        with self._lock:
            self._take_snapshot()
        self._publish_occupancy()
        self._thread.start()

    def submit(self, request_id: str, prompt: list[int], params: SamplingParams,
               sink: Callable[[TokenEvent], None], trace_context: Mapping[str, str] | None = None,
               prefix: PrefixHints = PrefixHints(), prior_output: int = 0, movable: bool = False,
               imported_state: bool = False) -> None:
        """Queues a sequence whose events go to `sink` (called on the engine thread; must not block).
        trace_context: the W3C trace headers of the caller's span (the Submit's), or None. prefix: its cache salt
        and message boundaries. prior_output: the prompt's last tokens that are the sequence's own earlier output
        (a continuation; Engine.add_request). movable: a drain hands it over. imported_state: it starts from the
        state imported under its id.

        Raises the engine's named errors (InvalidRequest, ContextTooLong, DuplicateRequest) at once, ShuttingDown,
        or StateUnavailable."""
        arrived_at = time.monotonic()
        traced = TracedRequest(dict(trace_context)) if trace_context and tracing.enabled() else None
        matcher = self.engine.check_request(request_id, prompt, params, prior_output)
        PrefixCache.message_points(request_id, list(prefix.boundaries), len(prompt))  # bad boundaries: refused now
        with self._lock:
            if self.failure is not None:
                raise ShuttingDown(f"request {request_id!r} refused: {self.failure}")
            if self._stopping:
                raise ShuttingDown(f"shard is draining; request {request_id!r} refused")
            if request_id in self._sinks:
                raise DuplicateRequest(f"request id {request_id!r} is already live on this shard")
            imported = self._imported(request_id, prompt) if imported_state else None
            self._sinks[request_id] = sink
            self._intake.append(_Submitted(request_id, list(prompt), params, matcher, arrived_at, traced, prefix,
                                           prior_output, movable and self.engine.sync.world == 1, imported))
            self._snapshot = dataclasses.replace(self._snapshot, queued=self._snapshot.queued + 1,
                                                 queued_tokens=self._snapshot.queued_tokens + len(prompt))
            self._lock.notify()

    def _imported(self, request_id: str, prompt: list[int]) -> SequenceState:
        state = self.imports.take(request_id)
        if state is None:
            raise StateUnavailable(f"request {request_id!r} asks for an imported state, and none is held under its id "
                                   f"(dropped {self.imports.hold_s:g} s after import, or never imported)")
        check_continues(request_id, prompt, state)
        return state

    def cancel(self, request_id: str) -> bool:
        """Asks the engine thread to stop a live sequence (it finishes with "cancelled" and frees its slot and
        blocks before the next step). False when the id is not live."""
        with self._lock:
            if request_id not in self._sinks:
                return False
            self._cancels.append(request_id)
            self._lock.notify()
            return True

    def load(self) -> LoadSnapshot:
        """The scheduler as of the last step, submit or cancel. Never waits for a step: Load and health probes
        must answer while a long prefill pass runs."""
        return self._snapshot

    @property
    def draining(self) -> bool:
        return self._stopping

    def stop(self, timeout: float | None = None, move: bool = False) -> None:
        """Refuses new work, lets in-flight sequences finish (drain), then stops the thread. move: the movable ones
        are handed over instead (their states wait in `exports`)."""
        with self._lock:
            self._stopping = True
            self._move_out = move
            self._lock.notify()
        self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.before_serving is not None:
                self.before_serving(self.engine)
            self.ready.set()
            self._serve()
        except Exception as e:  # noqa: BLE001 - a step that raised leaves the engine unknown: fatal, reported
            self._fail(e)
        finally:
            self.ready.set()

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not (self._intake or self._cancels or self.engine.has_work() or self._stopping):
                    self._wait_for_work()
                intake, self._intake = self._intake, []
                cancels, self._cancels = self._cancels, []
                move_out, self._move_out = self._move_out, False
            events = self._take_in(intake, cancels)
            if move_out:
                events += self._hand_over()
            if not events and not self.engine.has_work() and self._stopping:
                return
            result = self._step() if self.engine.has_work() else StepResult()
            result.events[:0] = events
            with self._lock:
                for event in result.events:
                    self._route(event)
                self._take_snapshot()
            self._record(result)

    def _step(self) -> StepResult:
        return self.engine.step()

    def _wait_for_work(self) -> None:
        """Called with the lock held while there is nothing to do."""
        self._lock.wait()

    def _take_in(self, intake: list[_Submitted], cancels: list[str]) -> list[TokenEvent]:
        """New requests into the engine, then cancels (a request cancelled before its first step never runs)."""
        events = []
        for sub in intake:
            try:
                seq = self.engine.add_request(sub.request_id, sub.prompt, sub.params, matcher=sub.matcher,
                                              prefix=sub.prefix, prior_output=sub.prior_output,
                                              movable=sub.movable, imported=sub.imported)
                seq.arrived_at = sub.arrived_at
                self._live[sub.request_id] = _Live(seq, sub.traced)
            except KimiServeError as e:  # checked at submit; only a changed engine could refuse it now
                log.error("request refused by the engine after its checks passed",
                          extra={"request_id": sub.request_id, "error": str(e)})
                events.append(TokenEvent(sub.request_id, None, 0, "error", len(sub.prompt), 0, str(e)))
        for request_id in cancels:
            event = self.engine.cancel(request_id)
            if event is not None:
                events.append(event)
        return events

    def _hand_over(self) -> list[TokenEvent]:
        """Every movable sequence stopped with a Moved event, its state (where it has one) packed into `exports`."""
        events = []
        for seq in [s for s in self.engine.sequences.values() if s.movable]:
            event, state = self.engine.move_out(seq.request_id)
            if state is not None:
                packed = state.pack()
                self.exports.put(seq.request_id, packed)
                event = dataclasses.replace(event, state_bytes=packed.nbytes)
            self.metrics.sequence_moved(state is not None, event.state_bytes)
            log.info("sequence handed over", extra={"request_id": seq.request_id, "state_tokens": event.moved_tokens,
                                                    "state_bytes": event.state_bytes,
                                                    "generated": event.completion_tokens})
            events.append(event)
        return events

    def _take_snapshot(self) -> None:
        """Called on the engine thread with the lock held; requests not yet taken in count as queued. Slots are the
        running sequences' (the prefix cache's are beside them); blocks only the cache holds count as free, since
        an admission takes them back."""
        s = self.engine.scheduler
        cache = self.engine.prefix_cache
        cached_blocks = cache.blocks_held if cache is not None else 0
        self._snapshot = LoadSnapshot(s.queued_tokens + sum(len(x.prompt) for x in self._intake), len(s.running),
                                      s.num_waiting + len(self._intake), s.max_running - len(s.running),
                                      s.blocks.num_free + cached_blocks, s.max_running, s.blocks.num_blocks,
                                      len(cache) if cache is not None else 0, cached_blocks)

    def _route(self, event: TokenEvent) -> None:
        """Called with the lock held."""
        sink = self._sinks.get(event.request_id)
        if sink is None:
            log.error("event for unknown request id", extra={"request_id": event.request_id})
            return
        live = self._live.pop(event.request_id, None) if event.finish_reason is not None else None
        if live is not None:
            event = dataclasses.replace(event, timing=SequenceTiming.of(live.seq))
            self._finished.append((live, event))
        sink(event)
        if event.finish_reason is not None:
            del self._sinks[event.request_id]
            self.metrics.sequence_finished(event.finish_reason)

    def _record(self, result: StepResult) -> None:
        """After the step's events went out: its passes, then the requests it finished."""
        world = self.engine.sync.world
        finished = {live.seq.request_id: live for live, _ in self._finished}
        for p in result.passes:
            record = PassRecord.of(p, 0, world)
            self.metrics.observe_pass(record)
            if p.kind == "prefill":
                record.log()
                for rid, n in zip(p.request_ids, p.seq_tokens):
                    live = self._live.get(rid) or finished.get(rid)
                    if live is not None and live.traced is not None:
                        live.traced.prefills.append(PrefillPart(p.started, n, record))
        for live, event in self._finished:
            self.metrics.observe_request(event.timing, event.prompt_tokens, event.completion_tokens)
            if live.traced is not None:
                request_trace.emit(self.metrics.labels["shard"], live.seq, live.traced, event)
        self._finished.clear()
        self._publish_occupancy()
        self.metrics.set_handoff(self.engine.scheduler.imported_tokens, self.exports.expired, self.imports.expired)

    def _publish_occupancy(self) -> None:
        load = self.load()
        self.metrics.set_occupancy(load.running, load.queued, load.total_slots - load.free_slots,
                                   load.total_slots, load.total_blocks - load.free_blocks, load.total_blocks)
        cache = self.engine.prefix_cache
        if cache is not None:
            self.metrics.set_prefix_cache(cache.stats, load.prefix_entries, cache.max_entries, load.prefix_blocks,
                                          cache.host_entries, cache.host.max_entries if cache.host else 0,
                                          cache.host_bytes, self.engine.runner.kda_pool.bytes_per_slot)

    def _fail(self, error: Exception) -> None:
        """Every live request ends with the failure and its usage so far; the fatal hooks stop the shard."""
        if self.failure is None:
            self.failure = f"engine loop failed with {type(error).__name__} (the shard's log has the traceback)"
        with self._lock:
            live = list(self._sinks)
            log.error("engine loop cannot continue; failing every live request", exc_info=error,
                      extra={"error": self.failure, "request_ids": live})
            self._stopping = True
            queued = {sub.request_id: len(sub.prompt) for sub in self._intake}
            for rid in live:
                seq = self.engine.sequences.get(rid)
                prompt, output = (len(seq.prompt), len(seq.output)) if seq is not None else (queued.get(rid, 0), 0)
                self._route(TokenEvent(rid, None, output, "error", prompt, output, self.failure))
            self.engine.sequences.clear()
            self._intake.clear()
        for hook in self.fatal_hooks:
            hook(self.failure)
