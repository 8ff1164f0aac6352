"""Prometheus metrics of weight streaming and host KV offload, registered on the registry the caller passes in.

Per pass: bytes streamed, copy time, compute time and stall time (the compute stream waiting on a copy), and the
layer fetches issued ahead for the next pass; slot occupancy as a gauge; KV pages on the host and the pages moved
each way. Series carry `shard` and `rank` labels like the shard's own metrics. A shard that streams nothing observes
nothing (histograms start empty).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PASS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class StreamingMetrics:
    def __init__(self, registry: CollectorRegistry, shard: str = "shard-0", rank: int = 0):
        self.registry = registry
        kw = {"labelnames": ("shard", "rank"), "registry": registry}
        self.bytes_streamed = Counter("kimiserve_stream_bytes", "Weight bytes copied host -> device", **kw)
        self.tensors_streamed = Counter("kimiserve_stream_tensors", "Checkpoint tensors copied host -> device", **kw)
        self.copy_seconds = Histogram("kimiserve_stream_copy_seconds",
                                      "Host-to-device weight copy time of one forward pass", buckets=PASS_BUCKETS,
                                      **kw)
        self.compute_seconds = Histogram("kimiserve_stream_compute_seconds",
                                         "Time streamed layers held their slots computing, per forward pass",
                                         buckets=PASS_BUCKETS, **kw)
        self.stall_seconds = Histogram("kimiserve_stream_stall_seconds",
                                       "Time compute waited for weight copies, per forward pass", buckets=PASS_BUCKETS,
                                       **kw)
        self.fetched_ahead = Counter("kimiserve_stream_fetched_ahead_layers",
                                     "Layer fetches issued during a forward pass for the next one (cross-pass "
                                     "prefetch: the next pass's first layers copy while this one's last compute)",
                                     **kw)
        self.slots_used = Gauge("kimiserve_stream_slots_used", "Device weight slots holding a layer (loading or in "
                                "use), sampled when a layer acquires its slot", **kw)
        self.slots_total = Gauge("kimiserve_stream_slots_total", "Device weight slots in the ring", **kw)
        self.kv_host_pages = Gauge("kimiserve_kv_host_pages", "MLA KV-cache pages held in host memory", **kw)
        self.kv_pages_offloaded = Counter("kimiserve_kv_pages_offloaded", "MLA KV-cache pages moved to the host",
                                          **kw)
        self.kv_pages_restored = Counter("kimiserve_kv_pages_restored", "MLA KV-cache pages moved back to the device",
                                         **kw)
        self.labels = {"shard": shard, "rank": str(rank)}

    def observe_pass(self, nbytes: int, tensors: int, copy_s: float, compute_s: float, stall_s: float,
                     fetched_ahead: int) -> None:
        self.bytes_streamed.labels(**self.labels).inc(nbytes)
        self.fetched_ahead.labels(**self.labels).inc(fetched_ahead)
        self.tensors_streamed.labels(**self.labels).inc(tensors)
        self.copy_seconds.labels(**self.labels).observe(copy_s)
        self.compute_seconds.labels(**self.labels).observe(compute_s)
        self.stall_seconds.labels(**self.labels).observe(stall_s)

    def set_slots(self, used: int, total: int) -> None:
        self.slots_used.labels(**self.labels).set(used)
        self.slots_total.labels(**self.labels).set(total)

    def kv_moved(self, offloaded: int, restored: int, on_host: int) -> None:
        if offloaded:
            self.kv_pages_offloaded.labels(**self.labels).inc(offloaded)
        if restored:
            self.kv_pages_restored.labels(**self.labels).inc(restored)
        self.kv_host_pages.labels(**self.labels).set(on_host)
