"""Prometheus metrics of batch jobs, registered on the router's registry (RouterMetrics.registry)."""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.batch import states
from router.metrics import LATENCY_BUCKETS

THROUGHPUT_WINDOW_S = 30.0


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.batches = Gauge("kimiserve_router_batches", "Batches in the store, by status", ["status"], registry=r)
        self.requests = Counter("kimiserve_router_batch_requests",
                                "Batch requests finished by this router, by outcome (completed | failed) and code",
                                ["outcome", "code"], registry=r)
        self.queue_depth = Gauge("kimiserve_router_batch_queue_depth",
                                 "Requests of the batches this router runs without a result and not at a shard "
                                 "(not dispatched yet, or waiting for admission)",
                                 registry=r)
        self.running = Gauge("kimiserve_router_batch_running_requests",
                             "Batch requests dispatched and past admission (at a shard, or being tokenized)",
                             registry=r)
        self.prompt_tokens = Counter("kimiserve_router_batch_prompt_tokens", "Prompt tokens of batch responses",
                                     registry=r)
        self.generation_tokens = Counter("kimiserve_router_batch_generation_tokens",
                                         "Generated tokens of batch responses (rate() = batch throughput)", registry=r)
        self.throughput = Gauge("kimiserve_router_batch_throughput_tokens_per_second",
                                f"Generated tokens per second of batch responses over the last "
                                f"{THROUGHPUT_WINDOW_S:.0f} s", registry=r)
        self.request_seconds = Histogram("kimiserve_router_batch_request_duration_seconds",
                                         "Start to result of one batch request run", buckets=LATENCY_BUCKETS,
                                         registry=r)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def request_finished(self, ok: bool, code: str, prompt_tokens: int, completion_tokens: int,
                         seconds: float | None) -> None:
        self.requests.labels("completed" if ok else "failed", code).inc()
        if ok:
            self.prompt_tokens.inc(prompt_tokens)
            self.generation_tokens.inc(completion_tokens)
            self._recent.append((time.monotonic(), completion_tokens))
        if seconds is not None:
            self.request_seconds.observe(seconds)

    def set_statuses(self, counts: dict[str, int]) -> None:
        for status in states.STATUSES:
            self.batches.labels(status).set(counts.get(status, 0))

    def update_throughput(self) -> None:
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        self.throughput.set(sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S)
