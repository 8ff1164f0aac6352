"""Router backpressure: at most `max_in_flight` requests at the shards, at most `max_queued` waiting for that;
beyond both a request is refused at once with RESOURCE_EXHAUSTED instead of piling up."""

from __future__ import annotations

import asyncio
import contextlib

from router.errors import Overloaded
from router.metrics import RouterMetrics


class Admission:
    def __init__(self, max_in_flight: int, max_queued: int, metrics: RouterMetrics):
        self._sem = asyncio.Semaphore(max_in_flight)
        self.max_in_flight, self.max_queued = max_in_flight, max_queued
        self._waiting = 0
        self._metrics = metrics

    @contextlib.asynccontextmanager
    async def slot(self, request_id: str):
        if self._sem.locked() and self._waiting >= self.max_queued:
            raise Overloaded(f"router queue full ({self._waiting} waiting, {self.max_in_flight} in flight); "
                             f"request {request_id!r} refused, retry later")
        self._waiting += 1
        self._metrics.queued.set(self._waiting)
        try:
            await self._sem.acquire()
        finally:
            self._waiting -= 1
            self._metrics.queued.set(self._waiting)
        self._metrics.in_flight.inc()
        try:
            yield
        finally:
            self._metrics.in_flight.dec()
            self._sem.release()
