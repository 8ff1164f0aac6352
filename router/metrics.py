"""Prometheus metrics of the router (request-level). Shard-side timings live on the shards; the prefill time the
router reports per request is the shard's own measure, carried back in the sequence's Finished event."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kimiserve import buckets

LATENCY_BUCKETS = buckets.REQUEST_SECONDS
TPOT_BUCKETS = buckets.TOKEN_GAP_SECONDS
# How a sequence's shard was lost (router/errors.py ShardLost.kind), and why a failover was refused
# (router/failover.py FailoverRefused.why): the label values of the failover counters.
LOST_REASONS = ("stream_ended", "stream_broke", "probes_failed", "refused", "removed", "drained")
FAILOVER_FAILURES = ("bound", "context", "no_shard")
# What became of a sequence a draining shard handed over (router/generation.py _relay): its state moved to the next
# shard, or the next shard recomputed because there was no state, the draining shard was gone, or the relay failed.
MIGRATION_OUTCOMES = ("moved", "no_state", "source_gone", "relay_failed")


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
        self.prefill_time = Histogram("kimiserve_router_prefill_seconds",
                                      "Shard-measured prefill of a request: its first prefill pass to its first token",
                                      ["method"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kimiserve_router_inter_token_latency_seconds",
                             "Gap between two consecutive output tokens of a request, as the router receives them",
                             ["method"], buckets=TPOT_BUCKETS, registry=r)
        self.prompt_length = Histogram("kimiserve_router_request_prompt_tokens", "Prompt length of a finished request",
                                       ["method"], buckets=buckets.TOKENS, registry=r)
        self.generation_length = Histogram("kimiserve_router_request_generation_tokens",
                                           "Tokens a finished request generated", ["method"], buckets=buckets.TOKENS,
                                           registry=r)
        self.finished = Counter("kimiserve_router_finished_requests",
                                "Requests whose generation ended, by finish reason (stop, length, cancelled, error; "
                                "'none' when the stream failed before a finish)", ["method", "finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("kimiserve_router_prompt_tokens", "Prompt tokens of finished requests",
                                     ["method"], registry=r)
        self.generation_tokens = Counter("kimiserve_router_generation_tokens",
                                         "Generated tokens of finished requests", ["method"], registry=r)
        # Failover (router/failover.py): sequences moved to another shard when theirs was lost, by how it was lost
        # (stream_ended, stream_broke, probes_failed, refused, removed; drained: handed over by a draining shard);
        # the prompt tokens their continuations prefill again (unless the new shard's prefix cache held them; a moved
        # state's tokens are not counted); loss to the continuation's first
        # event; streams that failed anyway (bound: --max-failovers spent; context: the continuation fits no shard;
        # no_shard: none in rotation).
        self.failovers = Counter("kimiserve_router_failovers", "Sequences failed over to another shard, by reason",
                                 ["reason"], registry=r)
        self.failover_recomputed_tokens = Counter("kimiserve_router_failover_recomputed_prompt_tokens",
                                                  "Prompt tokens (original prompt + tokens generated so far) that "
                                                  "failover continuations prefill again (not those a moved state "
                                                  "holds)", registry=r)
        self.failover_seconds = Histogram("kimiserve_router_failover_seconds",
                                          "A sequence's shard lost to the first event of its continuation",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.failover_failed = Counter("kimiserve_router_failover_failed_streams",
                                       "Streams failed although failover was tried, by why", ["why"], registry=r)
        # Planned moves (a draining shard handing its sequences over, shard_svc/engine/handoff.py): by outcome; the
        # bytes of the states relayed; how long a relay took (export, transfer, import).
        self.migrations = Counter("kimiserve_router_state_migrations",
                                  "Sequences a draining shard handed over, by outcome: moved (the state went to the "
                                  "next shard), or the next shard recomputed (no_state, source_gone, relay_failed)",
                                  ["outcome"], registry=r)
        self.migration_bytes = Counter("kimiserve_router_state_migration_bytes",
                                       "Bytes of sequence states relayed from draining shards", registry=r)
        self.migration_seconds = Histogram("kimiserve_router_state_migration_seconds",
                                           "Relaying one moved sequence's state: export, transfer and import",
                                           buckets=LATENCY_BUCKETS, registry=r)
        for outcome in MIGRATION_OUTCOMES:
            self.migrations.labels(outcome)
        for reason in LOST_REASONS:  # every series from the start: a rate over none is no data, not zero
            self.failovers.labels(reason)
        for why in FAILOVER_FAILURES:
            self.failover_failed.labels(why)
        self.queued = Gauge("kimiserve_router_queued_requests", "Requests waiting for router admission",
                            registry=r)
        self.in_flight = Gauge("kimiserve_router_in_flight_requests", "Requests sent to shards", registry=r)
        self.shard_healthy = Gauge("kimiserve_router_shard_healthy", "1 if the shard is in rotation", ["shard"],
                                   registry=r)
