"""Router backpressure: at most `max_in_flight` requests at the shards, at most `max_queued` waiting for that;
beyond both a request is refused at once with RESOURCE_EXHAUSTED instead of piling up.

Two priorities (interactive first): a freed slot always goes to the oldest waiting interactive request before any
batch request. Batch requests are never refused (their queue is bounded by the per-batch concurrency limits) and
additionally wait while the shards' total capacity (`batch_capacity()`, in sequences) is taken, so a batch only
uses capacity interactive traffic leaves free. The priority of a request is read from the `PRIORITY` context
variable, which the batch runner sets in its own tasks, so callers such as Generation need no parameter for it.
The queued-requests gauge counts interactive waiters only (the queue RESOURCE_EXHAUSTED protects); batch waiters
are part of the batch queue depth metric.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
from typing import Callable

from router.errors import Overloaded
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)
INTERACTIVE, BATCH = "interactive", "batch"
PRIORITY: contextvars.ContextVar[str] = contextvars.ContextVar("kimiserve_admission_priority", default=INTERACTIVE)


class Admission:
    def __init__(self, max_in_flight: int, max_queued: int, metrics: RouterMetrics):
        self.max_in_flight, self.max_queued = max_in_flight, max_queued
        self._in_flight = 0
        self._waiters: dict[str, collections.deque[asyncio.Future]] = {INTERACTIVE: collections.deque(),
                                                                        BATCH: collections.deque()}
        self._metrics = metrics
        # Sequences the healthy shards can run at once; batch requests wait while that many requests are in
        # flight. None: no limit beyond max_in_flight. Set by the batch wiring (router/batch).
        self.batch_capacity: Callable[[], int] | None = None

    def _free_for(self, priority: str) -> bool:
        if self._in_flight >= self.max_in_flight or self._waiters[INTERACTIVE]:
            return False
        if priority == INTERACTIVE:
            return True
        capacity = self.batch_capacity() if self.batch_capacity is not None else self.max_in_flight
        return not self._waiters[BATCH] and self._in_flight < capacity

    def waiting(self, priority: str) -> int:
        return len(self._waiters[priority])

    def _set_queued(self) -> None:
        # The router's queue (what RESOURCE_EXHAUSTED protects); batch waiters are counted in the batch metrics.
        self._metrics.queued.set(len(self._waiters[INTERACTIVE]))

    def kick(self) -> None:
        """Grants slots to waiters while possible: interactive first, then batch (while batch capacity is free).
        Called on every release, and by the batch runner when shard capacity may have changed."""
        for priority in (INTERACTIVE, BATCH):
            waiters = self._waiters[priority]
            while waiters and self._in_flight < self.max_in_flight:
                if priority == BATCH and (self._waiters[INTERACTIVE] or (
                        self.batch_capacity is not None and self._in_flight >= self.batch_capacity())):
                    break
                future = waiters.popleft()
                if future.done():  # its waiter was cancelled
                    continue
                self._in_flight += 1
                future.set_result(None)
        self._set_queued()

    @contextlib.asynccontextmanager
    async def slot(self, request_id: str):
        priority = PRIORITY.get()
        if self._free_for(priority):
            self._in_flight += 1
        else:
            waiting = len(self._waiters[INTERACTIVE])
            if priority == INTERACTIVE and waiting >= self.max_queued:
                raise Overloaded(f"router queue full ({waiting} waiting, {self.max_in_flight} in flight); "
                                 f"request {request_id!r} refused, retry later")
            future = asyncio.get_running_loop().create_future()
            self._waiters[priority].append(future)
            self._set_queued()
            log.debug("admission queued", extra={"request_id": request_id, "priority": priority})
            try:
                await future  # kick() counted this request in flight before granting it
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._release()  # granted, then cancelled before it could use the slot
                else:
                    future.cancel()
                    self._waiters[priority].remove(future)
                    self._set_queued()
                raise
        log.debug("admission granted", extra={"request_id": request_id, "priority": priority})
        self._metrics.in_flight.inc()
        try:
            yield
        finally:
            self._metrics.in_flight.dec()
            self._release()

    def _release(self) -> None:
        self._in_flight -= 1
        self.kick()
