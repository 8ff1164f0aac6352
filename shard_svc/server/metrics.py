"""Prometheus metrics of one shard. Every series carries `shard` and `rank` labels; aggregation is the query's job.

A shard that did no prefill exports no prefill observations (histograms start empty), never a fake zero.

Per pass (every rank of a shard group reports its own, under its rank): seconds, and for prefill the sequences,
tokens, chunks (model forwards) and most tokens in one chunk, for decode the rows. Per request (rank 0, which owns the
sequences): queue wait (to admission), wait for the device (to the first prefill pass), prefill time, time to first
token, time per output token, duration, prompt and generation lengths.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kimiserve import buckets
from shard_svc.engine.prefix_cache import SNAPSHOT_KINDS
from shard_svc.engine.sequence import SequenceTiming
from shard_svc.engine.pass_record import PassRecord

PASS_BUCKETS = buckets.PASS_SECONDS


class ShardMetrics:
    def __init__(self, shard: str, rank: int = 0, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = ("shard", "rank")
        kw = {"labelnames": labels, "registry": self.registry}
        self.prefill_seconds = Histogram("kimiserve_shard_prefill_pass_seconds",
                                         "Wall time of one prefill pass (packed prompt chunks)",
                                         buckets=PASS_BUCKETS, **kw)
        self.decode_seconds = Histogram("kimiserve_shard_decode_step_seconds",
                                        "Wall time of one batched decode step", buckets=PASS_BUCKETS, **kw)
        self.prefill_sequences = Histogram("kimiserve_shard_prefill_pass_sequences", "Sequences in one prefill pass",
                                           buckets=buckets.COUNT, **kw)
        self.prefill_pass_tokens = Histogram("kimiserve_shard_prefill_pass_tokens", "Prompt tokens in one prefill pass",
                                             buckets=buckets.TOKENS, **kw)
        self.prefill_chunks = Histogram("kimiserve_shard_prefill_pass_chunks",
                                        "Model forwards (micro-batches) the runner ran for one prefill pass",
                                        buckets=buckets.COUNT, **kw)
        self.prefill_max_chunk_tokens = Histogram("kimiserve_shard_prefill_pass_max_chunk_tokens",
                                                  "Most tokens in one chunk (micro-batch) of a prefill pass",
                                                  buckets=buckets.TOKENS, **kw)
        self.prefill_decode_rows = Histogram("kimiserve_shard_prefill_pass_decode_rows",
                                             "Decode steps that rode in one prefill pass (fair sharing folds the "
                                             "decodes into the pass while a long prompt prefills)",
                                             buckets=buckets.COUNT, **kw)
        self.request_queue = Histogram("kimiserve_shard_request_queue_seconds",
                                       "Arrival at the shard to admission (a state slot), per request",
                                       buckets=buckets.REQUEST_SECONDS, **kw)
        self.request_wait = Histogram("kimiserve_shard_request_wait_seconds",
                                      "Arrival at the shard to the start of the request's first prefill pass (to its "
                                      "first token when the prefix cache held the whole prompt): the time it waited "
                                      "for the device, admission included", buckets=buckets.REQUEST_SECONDS, **kw)
        self.decode_sequences = Histogram("kimiserve_shard_decode_step_sequences",
                                          "Sequences (rows) in one batched decode step", buckets=buckets.COUNT, **kw)
        self.request_prefill = Histogram("kimiserve_shard_request_prefill_seconds",
                                         "Start of a request's first prefill pass to its first token (all its chunks)",
                                         buckets=buckets.REQUEST_SECONDS, **kw)
        self.request_ttft = Histogram("kimiserve_shard_time_to_first_token_seconds",
                                      "Arrival at the shard to the request's first token",
                                      buckets=buckets.REQUEST_SECONDS, **kw)
        self.request_tpot = Histogram("kimiserve_shard_time_per_output_token_seconds",
                                      "Mean gap between a request's output tokens after the first",
                                      buckets=buckets.TOKEN_GAP_SECONDS, **kw)
        self.request_duration = Histogram("kimiserve_shard_request_duration_seconds",
                                          "Arrival at the shard to the request's finish",
                                          buckets=buckets.REQUEST_SECONDS, **kw)
        self.request_prompt = Histogram("kimiserve_shard_request_prompt_tokens", "Prompt length of a finished request",
                                        buckets=buckets.TOKENS, **kw)
        self.request_generation = Histogram("kimiserve_shard_request_generation_tokens",
                                            "Tokens a finished request generated", buckets=buckets.TOKENS, **kw)
        self.prefill_tokens = Counter("kimiserve_shard_prefill_tokens", "Prompt tokens prefilled", **kw)
        self.decode_tokens = Counter("kimiserve_shard_decode_tokens", "Tokens generated by decode steps", **kw)
        self.running = Gauge("kimiserve_shard_running_sequences", "Sequences holding a state slot", **kw)
        self.queued = Gauge("kimiserve_shard_queued_sequences", "Sequences waiting for admission", **kw)
        self.slots_used = Gauge("kimiserve_shard_state_slots_used", "KDA state slots in use", **kw)
        self.slots_total = Gauge("kimiserve_shard_state_slots_total", "KDA state slots in the pool", **kw)
        self.blocks_used = Gauge("kimiserve_shard_kv_blocks_used", "MLA KV-cache blocks in use", **kw)
        self.blocks_total = Gauge("kimiserve_shard_kv_blocks_total", "MLA KV-cache blocks in the pool", **kw)
        self.finished = Counter("kimiserve_shard_sequences_finished", "Sequences finished, by finish reason",
                                labelnames=labels + ("reason",), registry=self.registry)
        self.prefix_queried = Counter("kimiserve_shard_prefix_cache_queried_tokens",
                                      "Prompt tokens of admitted sequences, looked up in the prefix cache", **kw)
        self.prefix_hit = Counter("kimiserve_shard_prefix_cache_hit_tokens",
                                  "Prompt tokens restored from the prefix cache instead of prefilled", **kw)
        self.prefix_evictions = Counter("kimiserve_shard_prefix_cache_evictions",
                                        "Prefix cache entries evicted (entries full, or blocks needed)", **kw)
        self.prefix_entries = Gauge("kimiserve_shard_prefix_cache_entries", "Prefix cache entries held", **kw)
        self.prefix_entries_total = Gauge("kimiserve_shard_prefix_cache_entries_total",
                                          "Prefix cache entries the shard keeps at most", **kw)
        self.prefix_blocks = Gauge("kimiserve_shard_prefix_cache_kv_blocks",
                                   "KV blocks only the prefix cache holds (admissions reclaim them)", **kw)
        self.prefix_host_hit = Counter("kimiserve_shard_prefix_cache_host_hit_tokens",
                                       "Prompt tokens restored from the prefix cache's host tier (part of the hit "
                                       "tokens)", **kw)
        self.prefix_host_evictions = Counter("kimiserve_shard_prefix_cache_host_evictions",
                                             "Entries dropped from the prefix cache's host tier (gone for good)", **kw)
        self.prefix_host_entries = Gauge("kimiserve_shard_prefix_cache_host_entries",
                                         "Prefix cache entries held in host memory", **kw)
        self.prefix_host_entries_total = Gauge("kimiserve_shard_prefix_cache_host_entries_total",
                                               "Prefix cache entries the host tier keeps at most (0: off)", **kw)
        self.prefix_host_bytes = Gauge("kimiserve_shard_prefix_cache_host_bytes",
                                       "Host memory the prefix cache's host entries hold", **kw)
        self.prefix_snapshots = Counter("kimiserve_shard_prefix_cache_snapshots",
                                        "Prefix cache entries made, by snapshot point: prompt_end, message (a chat "
                                        "message boundary), interval, finish (a finished sequence's slot)",
                                        labelnames=labels + ("kind",), registry=self.registry)
        self.prefix_state_bytes = Gauge("kimiserve_shard_prefix_cache_state_bytes",
                                        "Device memory the prefix cache's entries hold in KDA state slots", **kw)
        self.prefix_state_bytes_limit = Gauge("kimiserve_shard_prefix_cache_state_bytes_limit",
                                              "The bound on it: --prefix-cache-entries x one state slot's bytes "
                                              "(allocated at startup)", **kw)
        self.labels = {"shard": shard, "rank": str(rank)}
        self._prefix_seen = (0, 0, 0, 0, 0)
        self._snapshots_seen = {kind: 0 for kind in SNAPSHOT_KINDS}

    def observe_pass(self, p: PassRecord, count_tokens: bool = True) -> None:
        """Under the rank that ran the pass. count_tokens: add to the token counters, which are group facts that
        only rank 0 counts (a follower's passes carry the same tokens)."""
        labels = {"shard": self.labels["shard"], "rank": str(p.rank)}
        if p.kind == "prefill":
            self.prefill_seconds.labels(**labels).observe(p.seconds)
            self.prefill_sequences.labels(**labels).observe(p.sequences)
            self.prefill_pass_tokens.labels(**labels).observe(p.tokens)
            self.prefill_chunks.labels(**labels).observe(p.chunks)
            self.prefill_max_chunk_tokens.labels(**labels).observe(p.max_chunk_tokens)
            self.prefill_decode_rows.labels(**labels).observe(p.decode_rows)
            if count_tokens:
                self.prefill_tokens.labels(**labels).inc(p.tokens)
                self.decode_tokens.labels(**labels).inc(p.decode_rows)
        else:
            self.decode_seconds.labels(**labels).observe(p.seconds)
            self.decode_sequences.labels(**labels).observe(p.sequences)
            if count_tokens:
                self.decode_tokens.labels(**labels).inc(p.tokens)

    def observe_request(self, t: SequenceTiming, prompt_tokens: int, generated: int) -> None:
        """A finished request; a phase it never reached (None) is not observed."""
        lab = self.labels
        self.request_queue.labels(**lab).observe(t.queue_s)
        if t.wait_s is not None:
            self.request_wait.labels(**lab).observe(t.wait_s)
        self.request_duration.labels(**lab).observe(t.duration_s)
        self.request_prompt.labels(**lab).observe(prompt_tokens)
        self.request_generation.labels(**lab).observe(generated)
        if t.prefill_s is not None:
            self.request_prefill.labels(**lab).observe(t.prefill_s)
        if t.time_to_first_token_s is not None:
            self.request_ttft.labels(**lab).observe(t.time_to_first_token_s)
        if t.decode_s is not None and generated > 1:
            self.request_tpot.labels(**lab).observe(t.decode_s / (generated - 1))

    def set_occupancy(self, running: int, queued: int, slots_used: int, slots_total: int, blocks_used: int,
                      blocks_total: int) -> None:
        for gauge, value in ((self.running, running), (self.queued, queued), (self.slots_used, slots_used),
                             (self.slots_total, slots_total), (self.blocks_used, blocks_used),
                             (self.blocks_total, blocks_total)):
            gauge.labels(**self.labels).set(value)

    def sequence_finished(self, reason: str) -> None:
        self.finished.labels(reason=reason, **self.labels).inc()

    def set_prefix_cache(self, stats, entries: int, max_entries: int, blocks: int, host_entries: int = 0,
                         max_host_entries: int = 0, host_bytes: int = 0, slot_bytes: int = 0) -> None:
        """stats: the cache's running totals (PrefixCacheStats); the counters advance by what is new since last.
        The host tier's series are exported with the cache, at 0 while the tier is off. slot_bytes: one KDA state
        slot's bytes (an entry's state)."""
        for kind in SNAPSHOT_KINDS:
            made = getattr(stats, f"snapshots_{kind}")
            self.prefix_snapshots.labels(kind=kind, **self.labels).inc(made - self._snapshots_seen[kind])
            self._snapshots_seen[kind] = made
        now = (stats.queried_tokens, stats.hit_tokens, stats.evictions, stats.host_hit_tokens, stats.host_evictions)
        counters = (self.prefix_queried, self.prefix_hit, self.prefix_evictions, self.prefix_host_hit,
                    self.prefix_host_evictions)
        for counter, new, old in zip(counters, now, self._prefix_seen):
            # Touched even without an increase: with the cache on, no hit is a real 0 (the hit rate is 0, not absent).
            counter.labels(**self.labels).inc(new - old)
        self._prefix_seen = now
        for gauge, value in ((self.prefix_entries, entries), (self.prefix_entries_total, max_entries),
                             (self.prefix_blocks, blocks), (self.prefix_host_entries, host_entries),
                             (self.prefix_host_entries_total, max_host_entries),
                             (self.prefix_host_bytes, host_bytes), (self.prefix_state_bytes, entries * slot_bytes),
                             (self.prefix_state_bytes_limit, max_entries * slot_bytes)):
            gauge.labels(**self.labels).set(value)
