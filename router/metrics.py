"""Prometheus metrics of the router (request-level). Shard-side timings live on the shards."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("kimiserve_router_requests", "Finished requests by method and gRPC status",
                                ["method", "status"], registry=r)
        self.ttft = Histogram("kimiserve_router_time_to_first_token_seconds", "Arrival to first token",
                              ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kimiserve_router_time_per_output_token_seconds",
                              "Mean time between output tokens of one request (after the first)", ["method"],
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kimiserve_router_request_duration_seconds", "Arrival to last chunk", ["method"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("kimiserve_router_queue_seconds", "Wait for router admission", ["method"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kimiserve_router_prompt_tokens", "Prompt tokens of finished requests",
                                     ["method"], registry=r)
        self.generation_tokens = Counter("kimiserve_router_generation_tokens",
                                         "Generated tokens of finished requests", ["method"], registry=r)
        self.queued = Gauge("kimiserve_router_queued_requests", "Requests waiting for router admission",
                            registry=r)
        self.in_flight = Gauge("kimiserve_router_in_flight_requests", "Requests sent to shards", registry=r)
        self.shard_healthy = Gauge("kimiserve_router_shard_healthy", "1 if the shard is in rotation", ["shard"],
                                   registry=r)
