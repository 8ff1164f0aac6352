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
LABELS = ("shard", "rank")

# Every series once, keyed by what it is observed from: (name, help) and a histogram's buckets. The observe and set
# methods walk these tables, so a new series is a row here (and for a request, its value in observe_request).

PREFILL_PASS = {  # by PassRecord field, per prefill pass
    "seconds": ("kimiserve_shard_prefill_pass_seconds", "Wall time of one prefill pass (packed prompt chunks)",
                PASS_BUCKETS),
    "sequences": ("kimiserve_shard_prefill_pass_sequences", "Sequences in one prefill pass", buckets.COUNT),
    "tokens": ("kimiserve_shard_prefill_pass_tokens", "Prompt tokens in one prefill pass", buckets.TOKENS),
    "chunks": ("kimiserve_shard_prefill_pass_chunks",
               "Model forwards (micro-batches) the runner ran for one prefill pass", buckets.COUNT),
    "max_chunk_tokens": ("kimiserve_shard_prefill_pass_max_chunk_tokens",
                         "Most tokens in one chunk (micro-batch) of a prefill pass", buckets.TOKENS),
    "decode_rows": ("kimiserve_shard_prefill_pass_decode_rows",
                    "Decode steps that rode in one prefill pass (fair sharing folds the decodes into the pass while "
                    "a long prompt prefills)", buckets.COUNT),
    "graphed": ("kimiserve_shard_prefill_pass_graphed",
                "1 for a prefill pass replayed from CUDA graphs (small passes: --prefill-graph-tokens), 0 for one "
                "launched op by op: _sum counts the replayed passes", buckets.FLAG),
}
DECODE_STEP = {  # by PassRecord field, per decode step
    "seconds": ("kimiserve_shard_decode_step_seconds", "Wall time of one batched decode step", PASS_BUCKETS),
    "sequences": ("kimiserve_shard_decode_step_sequences", "Sequences (rows) in one batched decode step",
                  buckets.COUNT),
}
REQUEST = {  # by the values observe_request takes from a finished request
    "queue_s": ("kimiserve_shard_request_queue_seconds",
                "Arrival at the shard to admission (a state slot), per request", buckets.REQUEST_SECONDS),
    "wait_s": ("kimiserve_shard_request_wait_seconds",
               "Arrival at the shard to the start of the request's first prefill pass (to its first token when the "
               "prefix cache held the whole prompt): the time it waited for the device, admission included",
               buckets.REQUEST_SECONDS),
    "prefill_s": ("kimiserve_shard_request_prefill_seconds",
                  "Start of a request's first prefill pass to its first token (all its chunks)",
                  buckets.REQUEST_SECONDS),
    "time_to_first_token_s": ("kimiserve_shard_time_to_first_token_seconds",
                              "Arrival at the shard to the request's first token", buckets.REQUEST_SECONDS),
    "time_per_output_token_s": ("kimiserve_shard_time_per_output_token_seconds",
                                "Mean gap between a request's output tokens after the first",
                                buckets.TOKEN_GAP_SECONDS),
    "duration_s": ("kimiserve_shard_request_duration_seconds", "Arrival at the shard to the request's finish",
                   buckets.REQUEST_SECONDS),
    "prompt_tokens": ("kimiserve_shard_request_prompt_tokens", "Prompt length of a finished request",
                      buckets.TOKENS),
    "generated": ("kimiserve_shard_request_generation_tokens", "Tokens a finished request generated",
                  buckets.TOKENS),
}
OCCUPANCY = {  # gauges, by set_occupancy's arguments
    "running": ("kimiserve_shard_running_sequences", "Sequences holding a state slot"),
    "queued": ("kimiserve_shard_queued_sequences", "Sequences waiting for admission"),
    "slots_used": ("kimiserve_shard_state_slots_used", "KDA state slots in use"),
    "slots_total": ("kimiserve_shard_state_slots_total", "KDA state slots in the pool"),
    "blocks_used": ("kimiserve_shard_kv_blocks_used", "MLA KV-cache blocks in use"),
    "blocks_total": ("kimiserve_shard_kv_blocks_total", "MLA KV-cache blocks in the pool"),
}
PREFIX_COUNTERS = {  # by PrefixCacheStats field (running totals; the counters advance by what is new)
    "queried_tokens": ("kimiserve_shard_prefix_cache_queried_tokens",
                       "Prompt tokens of admitted sequences, looked up in the prefix cache"),
    "hit_tokens": ("kimiserve_shard_prefix_cache_hit_tokens",
                   "Prompt tokens restored from the prefix cache instead of prefilled"),
    "evictions": ("kimiserve_shard_prefix_cache_evictions",
                  "Prefix cache entries evicted (entries full, or blocks needed)"),
    "host_hit_tokens": ("kimiserve_shard_prefix_cache_host_hit_tokens",
                        "Prompt tokens restored from the prefix cache's host tier (part of the hit tokens)"),
    "host_evictions": ("kimiserve_shard_prefix_cache_host_evictions",
                       "Entries dropped from the prefix cache's host tier (gone for good)"),
}
PREFIX_GAUGES = {  # by the values set_prefix_cache sets
    "entries": ("kimiserve_shard_prefix_cache_entries", "Prefix cache entries held"),
    "max_entries": ("kimiserve_shard_prefix_cache_entries_total", "Prefix cache entries the shard keeps at most"),
    "blocks": ("kimiserve_shard_prefix_cache_kv_blocks",
               "KV blocks only the prefix cache holds (admissions reclaim them)"),
    "host_entries": ("kimiserve_shard_prefix_cache_host_entries", "Prefix cache entries held in host memory"),
    "max_host_entries": ("kimiserve_shard_prefix_cache_host_entries_total",
                         "Prefix cache entries the host tier keeps at most (0: off)"),
    "host_bytes": ("kimiserve_shard_prefix_cache_host_bytes", "Host memory the prefix cache's host entries hold"),
    "state_bytes": ("kimiserve_shard_prefix_cache_state_bytes",
                    "Device memory the prefix cache's entries hold in KDA state slots"),
    "state_bytes_limit": ("kimiserve_shard_prefix_cache_state_bytes_limit",
                          "The bound on it: --prefix-cache-entries x one state slot's bytes (allocated at startup)"),
}


class ShardMetrics:
    def __init__(self, shard: str, rank: int = 0, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.labels = {"shard": shard, "rank": str(rank)}
        self._passes = {"prefill": self._histograms(PREFILL_PASS), "decode": self._histograms(DECODE_STEP)}
        self._request = self._histograms(REQUEST)
        self._occupancy = self._series(Gauge, OCCUPANCY)
        self._prefix_counters = self._series(Counter, PREFIX_COUNTERS)
        self._prefix_gauges = self._series(Gauge, PREFIX_GAUGES)
        self.prefill_tokens = Counter("kimiserve_shard_prefill_tokens", "Prompt tokens prefilled", LABELS,
                                      registry=self.registry)
        self.kernels_after_warmup = Counter(
            "kimiserve_shard_kernels_after_warmup", "Triton kernel variants first met after the warm-up (each one "
            "compiled or loaded while a request waited; the log names them: shard_svc/engine/late_kernels.py)",
            LABELS, registry=self.registry)
        self.kernels_after_warmup.labels(**self.labels)  # 0 from the start: a shard that never met one
        self.decode_tokens = Counter("kimiserve_shard_decode_tokens", "Tokens generated by decode steps", LABELS,
                                     registry=self.registry)
        self.finished = Counter("kimiserve_shard_sequences_finished", "Sequences finished, by finish reason",
                                LABELS + ("reason",), registry=self.registry)
        self.prefix_snapshots = Counter("kimiserve_shard_prefix_cache_snapshots",
                                        "Prefix cache entries made, by snapshot point: prompt_end, message (a chat "
                                        "message boundary), interval, finish (a finished sequence's slot)",
                                        LABELS + ("kind",), registry=self.registry)
        # Handing sequences over (shard_svc/engine/handoff.py): moved out by a drain, with or without a state; the
        # states' bytes each way; tokens restored from imported states instead of prefilled; states dropped unclaimed.
        self.moved = Counter("kimiserve_shard_sequences_moved",
                             "Sequences a drain handed to another shard, by whether a state went with them (exported) "
                             "or the receiver recomputes (none)", LABELS + ("state",), registry=self.registry)
        self.state_bytes = Counter("kimiserve_shard_state_transfer_bytes",
                                   "Bytes of sequence states handed over, by direction (exported, imported)",
                                   LABELS + ("direction",), registry=self.registry)
        self.imported_tokens = Counter("kimiserve_shard_imported_state_tokens",
                                       "Tokens restored from states other shards handed over, instead of prefilled",
                                       LABELS, registry=self.registry)
        self.states_dropped = Counter("kimiserve_shard_states_dropped",
                                      "Sequence states dropped unclaimed after the hold time, by store (exports: "
                                      "never fetched; imports: never submitted)", LABELS + ("store",),
                                      registry=self.registry)
        for state in ("exported", "none"):  # every series from the start: a rate over none is no data, not zero
            self.moved.labels(state=state, **self.labels)
        for direction in ("exported", "imported"):
            self.state_bytes.labels(direction=direction, **self.labels)
        for store in ("exports", "imports"):
            self.states_dropped.labels(store=store, **self.labels)
        self.imported_tokens.labels(**self.labels)
        self._handoff_seen = {"imported_tokens": 0, "exports": 0, "imports": 0}
        self._prefix_seen = dict.fromkeys(PREFIX_COUNTERS, 0)
        self._snapshots_seen = dict.fromkeys(SNAPSHOT_KINDS, 0)

    def kernel_after_warmup(self) -> None:
        self.kernels_after_warmup.labels(**self.labels).inc()

    def _histograms(self, table: dict[str, tuple[str, str, tuple[float, ...]]]) -> dict[str, Histogram]:
        return {key: Histogram(name, doc, LABELS, registry=self.registry, buckets=bounds)
                for key, (name, doc, bounds) in table.items()}

    def _series(self, kind: type[Counter] | type[Gauge], table: dict[str, tuple[str, str]]) -> dict:
        return {key: kind(name, doc, LABELS, registry=self.registry) for key, (name, doc) in table.items()}

    def _set(self, gauges: dict[str, Gauge], values: dict[str, float]) -> None:
        for key, value in values.items():
            gauges[key].labels(**self.labels).set(value)

    def observe_pass(self, p: PassRecord, count_tokens: bool = True) -> None:
        """Under the rank that ran the pass. count_tokens: add to the token counters, which are group facts that
        only rank 0 counts (a follower's passes carry the same tokens)."""
        labels = {"shard": self.labels["shard"], "rank": str(p.rank)}
        for field, histogram in self._passes[p.kind].items():
            histogram.labels(**labels).observe(getattr(p, field))
        if not count_tokens:
            return
        if p.kind == "prefill":
            self.prefill_tokens.labels(**labels).inc(p.tokens)
            self.decode_tokens.labels(**labels).inc(p.decode_rows)
        else:
            self.decode_tokens.labels(**labels).inc(p.tokens)

    def observe_request(self, t: SequenceTiming, prompt_tokens: int, generated: int) -> None:
        """A finished request; a phase it never reached (None) is not observed."""
        tpot = t.decode_s / (generated - 1) if t.decode_s is not None and generated > 1 else None
        values = {"queue_s": t.queue_s, "wait_s": t.wait_s, "prefill_s": t.prefill_s,
                  "time_to_first_token_s": t.time_to_first_token_s, "time_per_output_token_s": tpot,
                  "duration_s": t.duration_s, "prompt_tokens": prompt_tokens, "generated": generated}
        for key, value in values.items():
            if value is not None:
                self._request[key].labels(**self.labels).observe(value)

    def set_occupancy(self, running: int, queued: int, slots_used: int, slots_total: int, blocks_used: int,
                      blocks_total: int) -> None:
        self._set(self._occupancy, {"running": running, "queued": queued, "slots_used": slots_used,
                                    "slots_total": slots_total, "blocks_used": blocks_used,
                                    "blocks_total": blocks_total})

    def sequence_moved(self, with_state: bool, state_bytes: int) -> None:
        self.moved.labels(state="exported" if with_state else "none", **self.labels).inc()
        self.state_bytes.labels(direction="exported", **self.labels).inc(state_bytes)

    def state_imported(self, state_bytes: int) -> None:
        self.state_bytes.labels(direction="imported", **self.labels).inc(state_bytes)

    def set_handoff(self, imported_tokens: int, exports_dropped: int, imports_dropped: int) -> None:
        """Running totals (the scheduler's, the stores'); the counters advance by what is new since last."""
        now = {"imported_tokens": imported_tokens, "exports": exports_dropped, "imports": imports_dropped}
        if now == self._handoff_seen:
            return  # every step calls this; almost every step moves nothing
        new = {key: now[key] - self._handoff_seen[key] for key in now}
        self._handoff_seen = now
        self.imported_tokens.labels(**self.labels).inc(new["imported_tokens"])
        for store in ("exports", "imports"):
            self.states_dropped.labels(store=store, **self.labels).inc(new[store])

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
        for field, counter in self._prefix_counters.items():
            total = getattr(stats, field)
            # Touched even without an increase: with the cache on, no hit is a real 0 (the hit rate is 0, not absent).
            counter.labels(**self.labels).inc(total - self._prefix_seen[field])
            self._prefix_seen[field] = total
        self._set(self._prefix_gauges, {"entries": entries, "max_entries": max_entries, "blocks": blocks,
                                        "host_entries": host_entries, "max_host_entries": max_host_entries,
                                        "host_bytes": host_bytes, "state_bytes": entries * slot_bytes,
                                        "state_bytes_limit": max_entries * slot_bytes})
