"""One source of truth for kimiserve's Grafana dashboard and Prometheus alerts.

Writes dashboards/kimiserve.json (a ConfigMap labelled grafana_dashboard: "1" in the chart) and
rules/kimiserve-alerts.yaml (a plain Prometheus rules file; the chart's PrometheusRule embeds the same groups).
Run `python helm/kimiserve/dashboards/generate.py` after editing; tests/deploy fail when the committed files are stale,
when an expression names a metric the services do not export, and when an expression returns no data from a real
Prometheus scraping a running stack.

Series carry the target labels `namespace` and `model` (the chart's ServiceMonitors set `model`); the dashboard is
templated on both. Aggregation across shards and routers is done here, in the queries
(docs/lessons.md#metrics-are-an-api).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[1]
DASHBOARD = CHART / "dashboards" / "kimiserve.json"
RULES = CHART / "rules" / "kimiserve-alerts.yaml"

SEL = 'namespace=~"$namespace", model=~"$model"'
RATE = "$__rate_interval"
# gRPC statuses that are the service's fault (or its overload), for the error-ratio alert.
SERVER_ERRORS = "INTERNAL|UNAVAILABLE|UNKNOWN|DEADLINE_EXCEEDED|DATA_LOSS|RESOURCE_EXHAUSTED"
NON_TERMINAL_BATCH = "validating|in_progress|finalizing|cancelling"

# Alert thresholds: edit here, regenerate.
TTFT_P99_SECONDS = 10
ERROR_RATIO = 0.05
SLOT_SATURATION = 0.95
BATCH_TRANSITION_MINUTES = 30  # validating / finalizing / cancelling should take minutes, not this long
BATCH_IDLE_MINUTES = 15  # batches in progress while no batch request finished for this long
# Weight streaming: share of the copy time the compute waited for (not hidden behind compute). Prefill at a healthy
# batch hides most of it (README: 67% hidden on the H200 slice), so more than half exposed is a setting to change.
STALL_SHARE = 0.5
# Host KV offload: pages restored from the host per minute, in device caches' worth (kv_blocks_total). Restoring the
# whole device cache every minute, sustained, means the running sequences' KV does not fit the device: sequences
# keep waiting to come back instead of decoding.
KV_RESTORE_TURNOVER_PER_MINUTE = 1.0
# A prefill pass holds every running decode for its whole wall time (the prefill token budget bounds it): a group's
# p99 pass above this stalls token streams visibly. Lower shard.prefillTokenBudget, or add shards.
PREFILL_PASS_P99_SECONDS = 5
# Requests waiting this long at a shard for a state slot (p99): the shards are short of slots, not just busy.
SHARD_QUEUE_P99_SECONDS = 30
# Time per output token p99 seen by clients: above this, streaming feels stalled.
TPOT_P99_SECONDS = 0.5

# What the streaming and host KV alerts measure, per shard process (tests/deploy query these alone and need data).
STREAM_STALL_SHARE = ("sum by (namespace, model, shard) (rate(kimiserve_stream_stall_seconds_sum[5m])) / "
                      "sum by (namespace, model, shard) (rate(kimiserve_stream_copy_seconds_sum[5m]))")
KV_RESTORE_TURNOVER = ("sum by (namespace, model, shard) (rate(kimiserve_kv_pages_restored_total[5m])) * 60 / "
                       "sum by (namespace, model, shard) (kimiserve_shard_kv_blocks_total)")
# What the prefill and per-request alerts measure (tests/deploy query these alone and need data from both shards).
# A shard group's prefill wall time is the max over its ranks: each rank times its own pass.
GROUP_PREFILL_PASS_P99 = ("max by (namespace, model, shard) (histogram_quantile(0.99, sum by (namespace, model, shard, "
                          "rank, le) (rate(kimiserve_shard_prefill_pass_seconds_bucket[5m]))))")
SHARD_QUEUE_P99 = ("histogram_quantile(0.99, sum by (namespace, model, shard, le) "
                   "(rate(kimiserve_shard_request_queue_seconds_bucket[5m])))")


def quantiles(metric: str, by: str = "", qs=(0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    group = f"{by}, le" if by else "le"
    legend = f"{{{{{by}}}}} p" if by else "p"
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
             f"{legend}{round(q * 100)}") for q in qs]


def usage(used: str, total: str) -> list[tuple[str, str]]:
    return [(f"sum by (shard) ({used}{{{SEL}}}) / sum by (shard) ({total}{{{SEL}}})", "{{shard}}")]


def mean(metric: str, legend: str) -> tuple[str, str]:
    """Mean of a histogram's observations over all series."""
    return (f"sum(rate({metric}_sum{{{SEL}}}[{RATE}])) / sum(rate({metric}_count{{{SEL}}}[{RATE}]))", legend)


def max_over_ranks(metric: str, q: float, per_shard: bool = True) -> str:
    """A quantile per shard and rank, then the max over ranks (per shard) or over everything: a shard group's wall
    time is its slowest rank's."""
    inner = f"histogram_quantile({q}, sum by (shard, rank, le) (rate({metric}_bucket{{{SEL}}}[{RATE}])))"
    return f"max by (shard) ({inner})" if per_shard else f"max({inner})"


def per_pass_mean(metric: str, legend: str) -> tuple[str, str]:
    return (f"sum by (shard) (rate({metric}_sum{{{SEL}}}[{RATE}])) / "
            f"sum by (shard) (rate({metric}_count{{{SEL}}}[{RATE}]))", f"{{{{shard}}}} {legend}")


# (row title, [(panel title, unit, [(expr, legend)], description)])
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], str]]]] = [
    ("Requests", [
        ("Request rate by status", "reqps",
         [(f"sum by (method, status) (rate(kimiserve_router_requests_total{{{SEL}}}[{RATE}]))",
           "{{method}} {{status}}")],
         "Finished requests per second by method and gRPC status, all routers."),
        ("Non-OK ratio", "percentunit",
         [(f'sum(rate(kimiserve_router_requests_total{{{SEL}, status!="OK"}}[{RATE}])) / '
           f"sum(rate(kimiserve_router_requests_total{{{SEL}}}[{RATE}]))", "non-OK")],
         "Share of requests that did not finish OK (client errors included; the alert counts server errors)."),
        ("Time to first token", "s", quantiles("kimiserve_router_time_to_first_token_seconds"),
         "Arrival at the router to the first token, quantiles over all routers."),
        ("Time per output token", "s", quantiles("kimiserve_router_time_per_output_token_seconds"),
         "Mean gap between output tokens of a request after the first."),
        ("End-to-end latency", "s", quantiles("kimiserve_router_request_duration_seconds"),
         "Arrival at the router to the last chunk."),
        ("Router queue time", "s", quantiles("kimiserve_router_queue_seconds"),
         "Wait for router admission (backpressure)."),
        ("Tokens per second", "short",
         [(f"sum(rate(kimiserve_router_prompt_tokens_total{{{SEL}}}[{RATE}]))", "prompt"),
          (f"sum(rate(kimiserve_router_generation_tokens_total{{{SEL}}}[{RATE}]))", "generation")],
         "Prompt and generated tokens of finished requests per second."),
        ("Queue depth", "short",
         [(f"sum(kimiserve_router_queued_requests{{{SEL}}})", "router queued"),
          (f"sum(kimiserve_router_in_flight_requests{{{SEL}}})", "router in flight"),
          (f"sum by (shard) (kimiserve_shard_queued_sequences{{{SEL}}})", "{{shard}} queued")],
         "Requests waiting for router admission, at the shards, and sequences queued on each shard."),
    ]),
    # Per request, as the shards measure it (arrival at the shard to finish), and the router's breakdown.
    ("Request latency", [
        ("Where a request's time went (mean)", "s",
         [mean("kimiserve_router_queue_seconds", "router queue"),
          mean("kimiserve_shard_request_queue_seconds", "shard queue"),
          mean("kimiserve_shard_request_prefill_seconds", "prefill"),
          mean("kimiserve_shard_time_to_first_token_seconds", "TTFT at the shard"),
          mean("kimiserve_router_time_to_first_token_seconds", "TTFT at the router"),
          mean("kimiserve_router_request_duration_seconds", "end to end")],
         "Mean seconds per request in each phase: waiting for router admission, waiting at the shard for a state "
         "slot, prefill (first prefill pass to first token: every chunk of the prompt and the passes between), time "
         "to first token at the shard and at the router (the gap is chat rendering, tokenizing and transport), and "
         "end to end (the rest is decode). A request's own trace splits the same phases (README: Explaining a slow "
         "request)."),
        ("Time to first token per shard", "s",
         quantiles("kimiserve_shard_time_to_first_token_seconds", "shard", (0.5, 0.99)),
         "Arrival at the shard to the first token: shard queue + prefill."),
        ("Time per output token per shard", "s",
         quantiles("kimiserve_shard_time_per_output_token_seconds", "shard", (0.5, 0.99)),
         "Mean gap between a request's tokens after the first, per shard: decode steps, and the prefill passes that "
         "run between them."),
        ("Shard queue wait per shard", "s", quantiles("kimiserve_shard_request_queue_seconds", "shard", (0.5, 0.99)),
         "Arrival at the shard to admission (a free state slot and room for the request's KV)."),
        ("Wait for the device per shard", "s", quantiles("kimiserve_shard_request_wait_seconds", "shard", (0.5, 0.99)),
         "Arrival at the shard to the request's first prefill pass: admission plus the passes it waited for a share "
         "of the prefill budget (fair sharing keeps this near one pass while a long prompt prefills)."),
        ("Prefill time per request, per shard", "s",
         quantiles("kimiserve_shard_request_prefill_seconds", "shard", (0.5, 0.99)),
         "A request's first prefill pass to its first token (a prompt over the prefill token budget takes several "
         "passes; prompts restored whole from the prefix cache have none)."),
        ("End-to-end per shard", "s", quantiles("kimiserve_shard_request_duration_seconds", "shard", (0.5, 0.99)),
         "Arrival at the shard to the request's finish."),
        ("Inter-token latency", "s", quantiles("kimiserve_router_inter_token_latency_seconds"),
         "Every gap between two consecutive tokens of a request, as the router receives them (TPOT is the mean of "
         "a request's gaps; this shows the stalls)."),
        ("Prompt and generation length", "short",
         [(expr, f"{kind} {legend}") for kind in ("prompt", "generation")
          for expr, legend in quantiles(f"kimiserve_router_request_{kind}_tokens", "", (0.5, 0.99))],
         "Tokens per finished request: prompt and generated (bucket bounds x4: quantiles are coarse)."),
        ("Finish reasons", "reqps",
         [(f"sum by (finish_reason) (rate(kimiserve_router_finished_requests_total{{{SEL}}}[{RATE}]))",
           "{{finish_reason}}")],
         "Requests per second by how their generation ended: stop, length, cancelled, error, none (the stream "
         "failed before a finish)."),
        ("Stream failover", "short",
         [(f"sum by (reason) (rate(kimiserve_router_failovers_total{{{SEL}}}[{RATE}]))", "failed over: {{reason}}"),
          (f"sum by (why) (rate(kimiserve_router_failover_failed_streams_total{{{SEL}}}[{RATE}]))",
           "failed anyway: {{why}}"),
          (f"sum(rate(kimiserve_router_failover_recomputed_prompt_tokens_total{{{SEL}}}[{RATE}]))",
           "prompt tokens sent again")],
         "Streams per second moved to another shard when theirs died or left mid-stream, by how it was lost "
         "(stream_ended, stream_broke, probes_failed, refused, removed); streams that failed anyway (bound: "
         "--max-failovers spent; context: the continuation fits no shard; no_shard: none in rotation); and the "
         "prompt tokens per second their continuations sent again (prefilled again unless a prefix cache held "
         "them)."),
        # A sum, not quantiles of kimiserve_router_failover_seconds: a quantile over no failover is no data, and
        # every panel must show data on a healthy stack (tests/deploy/test_stack.py).
        ("Failover pause", "s",
         [(f"sum(rate(kimiserve_router_failover_seconds_sum{{{SEL}}}[{RATE}]))", "pause per second")],
         "Seconds per second that streams stood still while failing over: their shard lost to the first event of "
         "the continuation on another shard. Divided by the failovers per second it is the mean pause; "
         "kimiserve_router_failover_seconds holds the whole distribution."),
        ("State moved by drains", "short",
         [(f"sum by (outcome) (rate(kimiserve_router_state_migrations_total{{{SEL}}}[{RATE}]))",
           "handed over: {{outcome}}"),
          (f"sum(rate(kimiserve_shard_imported_state_tokens_total{{{SEL}}}[{RATE}]))",
           "tokens restored instead of prefilled"),
          (f"sum(rate(kimiserve_router_state_migration_bytes_total{{{SEL}}}[{RATE}])) / 1048576",
           "MiB relayed")],
         "Streams per second a draining shard (SIGTERM, a rolling restart) handed over: moved (its state went to "
         "the next shard, which prefills only the token sent last) or recomputed (no_state: still queued; "
         "source_gone, relay_failed); the context tokens per second shards restored from moved states instead of "
         "prefilling them; and the MiB per second of state the routers relayed (docs/failover.md)."),
    ]),
    ("Prefill", [
        ("Prefill pass duration per shard", "s",
         [(max_over_ranks("kimiserve_shard_prefill_pass_seconds", q), f"{{{{shard}}}} p{round(q * 100)}")
          for q in (0.5, 0.99)],
         "Wall time of one prefill pass on each shard; for a shard group the max over its ranks (each rank times "
         "its own pass)."),
        ("Prefill pass p99, max over shards", "s",
         [(max_over_ranks("kimiserve_shard_prefill_pass_seconds", 0.99, per_shard=False), "max p99")],
         f"The slowest shard's (and rank's) p99 prefill pass; alert above {PREFILL_PASS_P99_SECONDS} s."),
        ("Prefill pass p99 per rank", "s",
         [(f"histogram_quantile(0.99, sum by (shard, rank, le) "
           f"(rate(kimiserve_shard_prefill_pass_seconds_bucket{{{SEL}}}[{RATE}])))", "{{shard}} rank {{rank}}")],
         "Each rank's own p99 pass: a rank far above the others is the group's straggler."),
        ("Prefill tokens per second of pass time", "short",
         [(f'sum by (shard) (rate(kimiserve_shard_prefill_pass_tokens_sum{{{SEL}, rank="0"}}[{RATE}])) / '
           f"max by (shard) (rate(kimiserve_shard_prefill_pass_seconds_sum{{{SEL}}}[{RATE}]))", "{{shard}}")],
         "Prompt tokens per second while prefilling (tokens / pass wall time, the slowest rank's)."),
        ("Tokens and sequences per prefill pass (mean)", "short",
         [per_pass_mean("kimiserve_shard_prefill_pass_tokens", "tokens"),
          per_pass_mean("kimiserve_shard_prefill_pass_sequences", "sequences")],
         "How full passes are: prompt tokens (at most the prefill token budget) and sequences packed in one pass."),
        ("Chunks per pass and tokens per chunk (mean)", "short",
         [per_pass_mean("kimiserve_shard_prefill_pass_chunks", "chunks"),
          per_pass_mean("kimiserve_shard_prefill_pass_max_chunk_tokens", "max tokens per chunk")],
         "Model forwards (micro-batches) the runner ran per pass, and the most tokens one of them held."),
        ("Prefill passes replayed from CUDA graphs", "percentunit",
         [per_pass_mean("kimiserve_shard_prefill_pass_graphed", "replayed")],
         "Share of prefill passes replayed from the prefill graphs (small passes: --prefill-graph-tokens) rather "
         "than launched op by op: on a GPU, a replayed pass costs its GPU time, not the host's launches."),
        ("Kernels first met after the warm-up", "short",
         [(f"sum by (shard) (increase(kimiserve_shard_kernels_after_warmup_total{{{SEL}}}[{RATE}]))",
           "{{shard}}")],
         "Triton kernel variants a request waited for (compiled or loaded; 0.5-1.4 s each on the 48B shape, every "
         "request of the pass behind it): each is a gap in the shard's warm-up, named with its specialization in "
         "the shard's log line \"kernel first met after the warm-up\"."),
        ("Prompt length per shard", "short",
         quantiles("kimiserve_shard_request_prompt_tokens", "shard", (0.5, 0.99)),
         "Prompt tokens of the requests each shard finished (bucket bounds x4)."),
    ]),
    ("Shards", [
        ("Decode step time per shard", "s",
         quantiles("kimiserve_shard_decode_step_seconds", "shard", (0.5, 0.99)),
         "Wall time of one batched decode step on each shard."),
        ("Shard tokens per second", "short",
         [(f"sum by (shard) (rate(kimiserve_shard_prefill_tokens_total{{{SEL}}}[{RATE}]))", "{{shard}} prefill"),
          (f"sum by (shard) (rate(kimiserve_shard_decode_tokens_total{{{SEL}}}[{RATE}]))", "{{shard}} decode")],
         "Prompt tokens prefilled and tokens decoded per second on each shard."),
        ("State-slot usage per shard", "percentunit",
         usage("kimiserve_shard_state_slots_used", "kimiserve_shard_state_slots_total"),
         "KDA state slots in use / in the pool."),
        ("KV-block usage per shard", "percentunit",
         usage("kimiserve_shard_kv_blocks_used", "kimiserve_shard_kv_blocks_total"),
         "MLA KV-cache blocks in use / in the pool."),
        ("Running sequences per shard", "short",
         [(f"sum by (shard) (kimiserve_shard_running_sequences{{{SEL}}})", "{{shard}}")],
         "Sequences holding a state slot."),
        ("Shard health (as routers see it)", "short",
         [(f"min by (shard) (kimiserve_router_shard_healthy{{{SEL}}})", "{{shard}}")],
         "1: in rotation on every router; 0: out of rotation on at least one."),
        ("Prefix cache hit rate per shard", "percentunit",
         [(f"sum by (shard) (rate(kimiserve_shard_prefix_cache_hit_tokens_total{{{SEL}}}[{RATE}])) / "
           f"sum by (shard) (rate(kimiserve_shard_prefix_cache_queried_tokens_total{{{SEL}}}[{RATE}]))",
           "{{shard}}"),
          (f"sum by (shard) (rate(kimiserve_shard_prefix_cache_host_hit_tokens_total{{{SEL}}}[{RATE}])) / "
           f"sum by (shard) (rate(kimiserve_shard_prefix_cache_queried_tokens_total{{{SEL}}}[{RATE}]))",
           "{{shard}} from the host tier")],
         "Share of admitted prompt tokens restored from the shard's prefix cache instead of prefilled, and the part "
         "of them copied back from its host tier."),
        ("Prefix cache entries per shard", "percentunit",
         usage("kimiserve_shard_prefix_cache_entries", "kimiserve_shard_prefix_cache_entries_total"),
         "Cached prefixes held / the most the shard keeps (--prefix-cache-entries); each holds one KDA state slot."),
        ("Prefix cache entries by tier", "short",
         [(f"sum by (shard) (kimiserve_shard_prefix_cache_entries{{{SEL}}})", "{{shard}} device"),
          (f"sum by (shard) (kimiserve_shard_prefix_cache_host_entries{{{SEL}}})", "{{shard}} host")],
         "Cached prefixes on the device and in the host tier (--prefix-host-entries; 0 when it is off)."),
        ("Prefix cache host memory per shard", "bytes",
         [(f"sum by (shard) (kimiserve_shard_prefix_cache_host_bytes{{{SEL}}})", "{{shard}}")],
         "Host memory the host tier's entries hold: a KDA state slot, the prefix's KV blocks and a logits row each."),
        ("Prefix cache evictions per second by tier", "short",
         [(f"sum by (shard) (rate(kimiserve_shard_prefix_cache_evictions_total{{{SEL}}}[{RATE}]))",
           "{{shard}} device"),
          (f"sum by (shard) (rate(kimiserve_shard_prefix_cache_host_evictions_total{{{SEL}}}[{RATE}]))",
           "{{shard}} host")],
         "Entries leaving the device (to the host tier when it is on) and entries dropped from the host tier."),
        ("Prefix cache snapshots per second by kind", "short",
         [(f"sum by (kind) (rate(kimiserve_shard_prefix_cache_snapshots_total{{{SEL}}}[{RATE}]))", "{{kind}}")],
         "Entries made: at prompt ends, chat message ends, every --prefix-state-interval tokens, and finished "
         "sequences' slots handed over."),
        ("Prefix cache state memory per shard", "percentunit",
         usage("kimiserve_shard_prefix_cache_state_bytes", "kimiserve_shard_prefix_cache_state_bytes_limit"),
         "Device memory the entries' KDA state slots hold / its bound (--prefix-cache-entries x one slot)."),
        ("Sequences finished per second", "short",
         [(f"sum by (reason) (rate(kimiserve_shard_sequences_finished_total{{{SEL}}}[{RATE}]))", "{{reason}}")],
         "Sequences finished on the shards, by finish reason."),
    ]),
    # Series exist only on shards that stream weights (--weights stream) or offload KV (--host-kv-gb): the row is
    # empty on a resident deployment.
    ("Weight streaming and host KV", [
        ("Streamed weight bytes per second", "Bps",
         [(f"sum by (shard) (rate(kimiserve_stream_bytes_total{{{SEL}}}[{RATE}]))", "{{shard}}")],
         "Weight bytes copied host -> device per second on each streaming shard (prefetch and on-demand experts)."),
        ("Copy, compute and stall per pass (mean)", "s",
         [per_pass_mean("kimiserve_stream_copy_seconds", "copy"),
          per_pass_mean("kimiserve_stream_compute_seconds", "compute"),
          per_pass_mean("kimiserve_stream_stall_seconds", "stall")],
         "Mean seconds per forward pass: weight copies, compute of streamed layers, and compute waiting on copies."),
        ("Stall share of copy time", "percentunit",
         [(f"sum by (shard) (rate(kimiserve_stream_stall_seconds_sum{{{SEL}}}[{RATE}])) / "
           f"sum by (shard) (rate(kimiserve_stream_copy_seconds_sum{{{SEL}}}[{RATE}]))", "{{shard}}")],
         "Stall / copy time: the share of copies not hidden behind compute (alert above "
         f"{STALL_SHARE:.0%}). Raise shard.weights.prefetchDepth or the batch to lower it."),
        ("Stall per pass", "s", quantiles("kimiserve_stream_stall_seconds", "shard", (0.5, 0.99)),
         "Compute waiting on weight copies in one forward pass, quantiles per shard."),
        ("Weight slot occupancy", "percentunit",
         usage("kimiserve_stream_slots_used", "kimiserve_stream_slots_total"),
         "Device weight slots holding a layer (loading or in use) / slots in the ring, sampled as layers take slots."),
        ("Layers fetched ahead per second", "short",
         [(f"sum by (shard) (rate(kimiserve_stream_fetched_ahead_layers_total{{{SEL}}}[{RATE}]))", "{{shard}}")],
         "Layer fetches issued during a pass for the next one (cross-pass prefetch: the next pass does not start "
         "cold)."),
        ("Host KV pages", "short",
         [(f"sum by (shard) (kimiserve_kv_host_pages{{{SEL}}})", "{{shard}}")],
         "MLA KV-cache pages held in host memory (sequences moved off the device, waiting to come back)."),
        ("KV pages offloaded and restored per second", "short",
         [(f"sum by (shard) (rate(kimiserve_kv_pages_offloaded_total{{{SEL}}}[{RATE}]))", "{{shard}} offloaded"),
          (f"sum by (shard) (rate(kimiserve_kv_pages_restored_total{{{SEL}}}[{RATE}]))", "{{shard}} restored")],
         "MLA KV pages moved to the host and back per second; a sustained restore rate is churn (alert)."),
    ]),
    ("Tokenizer", [
        ("Tokenizer RPC rate", "reqps",
         [(f"sum by (rpc, code) (rate(kimiserve_tokenizer_requests_total{{{SEL}}}[{RATE}]))", "{{rpc}} {{code}}")],
         "Tokenizer RPCs finished per second by rpc and status."),
        ("Tokenizer RPC p99", "s",
         [(f"histogram_quantile(0.99, sum by (rpc, le) "
           f"(rate(kimiserve_tokenizer_request_duration_seconds_bucket{{{SEL}}}[{RATE}])))", "{{rpc}}")],
         "Handler wall time per rpc."),
    ]),
    ("Batch", [
        ("Batch jobs by status", "short",
         [(f"max by (status) (kimiserve_router_batches{{{SEL}}})", "{{status}}")],
         "Batches in the store by status (routers sharing a store report the same counts: max, not sum)."),
        ("Batch requests", "short",
         [(f"sum(kimiserve_router_batch_queue_depth{{{SEL}}})", "queued"),
          (f"sum(kimiserve_router_batch_running_requests{{{SEL}}})", "running")],
         "Batch requests waiting and running on the routers."),
        ("Batch throughput", "short",
         [(f"sum(kimiserve_router_batch_throughput_tokens_per_second{{{SEL}}})", "generated tokens/s")],
         "Generated tokens per second of batch responses."),
    ]),
]

ALERTS: list[dict] = [
    {"alert": "KimiserveShardDown", "for": "2m", "severity": "warning",
     "expr": "kimiserve_router_shard_healthy == 0",
     "summary": "Shard {{ $labels.shard }} is out of the router's rotation",
     "description": "Router {{ $labels.instance }} has not been able to use shard {{ $labels.shard }} for 2 minutes "
                    "(health not SERVING or its stream broke)."},
    {"alert": "KimiserveNoHealthyShard", "for": "1m", "severity": "critical",
     "expr": "kimiserve_router_queued_requests unless on (namespace, instance) (kimiserve_router_shard_healthy == 1)",
     "summary": "Router {{ $labels.instance }} has no healthy shard",
     "description": "Every request to this router fails with UNAVAILABLE: no shard is discovered or in rotation."},
    {"alert": "KimiserveStreamsFailedDespiteFailover", "for": "1m", "severity": "warning",
     "expr": "sum by (namespace, model, why) (increase(kimiserve_router_failover_failed_streams_total[10m])) > 0",
     "summary": "Streams failed although the router tried to fail them over ({{ $labels.why }})",
     "description": "{{ $value }} streams lost their shard mid-stream and could not continue elsewhere in the last "
                    "10 minutes: bound (--max-failovers spent: shards keep dying), context (the continuation fits "
                    "no shard), no_shard (none in rotation). The router's log line \"stream failed despite "
                    "failover\" names each request and the shards tried."},
    {"alert": "KimiserveRouterQueueGrowing", "for": "10m", "severity": "warning",
     "expr": "kimiserve_router_queued_requests > 0 and deriv(kimiserve_router_queued_requests[10m]) > 0",
     "summary": "Router {{ $labels.instance }} admission queue keeps growing",
     "description": "{{ $value }} requests wait for admission and the queue has grown for 10 minutes: add shards."},
    {"alert": "KimiserveShardQueueGrowing", "for": "10m", "severity": "warning",
     "expr": "kimiserve_shard_queued_sequences > 0 and deriv(kimiserve_shard_queued_sequences[10m]) > 0",
     "summary": "Shard {{ $labels.shard }} queue keeps growing",
     "description": "{{ $value }} sequences wait for a state slot or KV blocks on {{ $labels.shard }}."},
    {"alert": "KimiserveTTFTHigh", "for": "10m", "severity": "warning",
     "expr": f"histogram_quantile(0.99, sum by (namespace, model, le) "
             f"(rate(kimiserve_router_time_to_first_token_seconds_bucket[5m]))) > {TTFT_P99_SECONDS}",
     "summary": f"TTFT p99 of {{{{ $labels.model }}}} is over {TTFT_P99_SECONDS} s",
     "description": "Time to first token p99 is {{ $value | humanizeDuration }} over the last 5 minutes."},
    {"alert": "KimiserveTPOTHigh", "for": "10m", "severity": "warning",
     "expr": f"histogram_quantile(0.99, sum by (namespace, model, le) "
             f"(rate(kimiserve_router_time_per_output_token_seconds_bucket[5m]))) > {TPOT_P99_SECONDS}",
     "summary": f"TPOT p99 of {{{{ $labels.model }}}} is over {TPOT_P99_SECONDS} s",
     "description": "Time per output token p99 is {{ $value | humanizeDuration }} over the last 5 minutes: token "
                    "streams stall. Check the prefill pass duration (long passes hold every decode) and the running "
                    "sequences per shard."},
    {"alert": "KimiservePrefillPassSlow", "for": "15m", "severity": "warning",
     "expr": f"{GROUP_PREFILL_PASS_P99} > {PREFILL_PASS_P99_SECONDS}",
     "summary": "Prefill passes on shard {{ $labels.shard }} take over " + f"{PREFILL_PASS_P99_SECONDS} s",
     "description": "The shard's p99 prefill pass (max over its ranks) is {{ $value | humanizeDuration }}; every "
                    "running decode waits for each pass. Lower shard.prefillTokenBudget or add shards; a slow rank "
                    "shows in the dashboard's Prefill pass p99 per rank."},
    {"alert": "KimiserveShardQueueWaitHigh", "for": "10m", "severity": "warning",
     "expr": f"{SHARD_QUEUE_P99} > {SHARD_QUEUE_P99_SECONDS}",
     "summary": "Requests wait over " + f"{SHARD_QUEUE_P99_SECONDS} s" + " for a slot on shard {{ $labels.shard }}",
     "description": "p99 wait at the shard for a state slot and KV room is {{ $value | humanizeDuration }}: raise "
                    "shard.numStateSlots / shard.numKvBlocks if the GPU has room, or add shards."},
    {"alert": "KimiserveErrorRatioHigh", "for": "5m", "severity": "critical",
     "expr": f'sum by (namespace, model) (rate(kimiserve_router_requests_total{{status=~"{SERVER_ERRORS}"}}[5m])) / '
             f"sum by (namespace, model) (rate(kimiserve_router_requests_total[5m])) > {ERROR_RATIO}",
     "summary": f"More than {ERROR_RATIO:.0%} of {{{{ $labels.model }}}} requests fail",
     "description": "{{ $value | humanizePercentage }} of requests ended with a server-side status ("
                    + SERVER_ERRORS.replace("|", ", ") + ")."},
    {"alert": "KimiserveStateSlotsSaturated", "for": "15m", "severity": "warning",
     "expr": f"kimiserve_shard_state_slots_used / kimiserve_shard_state_slots_total >= {SLOT_SATURATION} "
             f"and kimiserve_shard_queued_sequences > 0",
     "summary": "Shard {{ $labels.shard }} has no free state slots",
     "description": f"At least {SLOT_SATURATION:.0%} of the KDA state slots are in use and sequences queue: "
                    "raise shard.numStateSlots or add shards."},
    {"alert": "KimiserveBatchStuckInTransition", "for": "5m", "severity": "warning",
     "expr": f'min_over_time(kimiserve_router_batches{{status=~"validating|finalizing|cancelling"}}'
             f"[{BATCH_TRANSITION_MINUTES}m]) > 0",
     "summary": "Batches have been {{ $labels.status }} for over " + f"{BATCH_TRANSITION_MINUTES} minutes",
     "description": "{{ $value }} batch(es) stayed in a transitional status without interruption; "
                    "every batch must reach a terminal status (docs/lessons.md#every-request-and-batch-ends)."},
    {"alert": "KimiserveBatchStalled", "for": f"{BATCH_IDLE_MINUTES}m", "severity": "warning",
     "expr": f'max by (namespace, model) (kimiserve_router_batches{{status="in_progress"}}) > 0 '
             f"unless on (namespace, model) "
             f"(sum by (namespace, model) "
             f"(increase(kimiserve_router_batch_requests_total[{BATCH_IDLE_MINUTES}m])) > 0)",
     "summary": "Batches are in_progress but none of their requests finished in "
                f"{BATCH_IDLE_MINUTES} minutes",
     "description": "{{ $value }} batch(es) in_progress with no progress: a stuck non-terminal batch."},
    {"alert": "KimiserveWeightStreamingStalled", "for": "15m", "severity": "warning",
     "expr": f"{STREAM_STALL_SHARE} > {STALL_SHARE}",
     "summary": "Weight copies on shard {{ $labels.shard }} are not hidden behind compute",
     "description": f"Over {STALL_SHARE:.0%} of the weight-copy time is not hidden behind compute "
                    "({{ $value | humanizePercentage }} over 5 minutes): passes wait on the host-to-device link. "
                    "Raise shard.weights.prefetchDepth (and slots) when the ring is too shallow, or batch more tokens "
                    "per pass (shard.prefillTokenBudget, shard.numStateSlots). Small-batch decode is copy-bound by "
                    "design: if its latency is not acceptable, spread the model over more GPUs (shard.tp / shard.ep) "
                    "instead of streaming it."},
    {"alert": "KimiserveHostKVChurn", "for": "15m", "severity": "warning",
     "expr": f"{KV_RESTORE_TURNOVER} > {KV_RESTORE_TURNOVER_PER_MINUTE}",
     "summary": "Shard {{ $labels.shard }} keeps moving KV pages back from the host",
     "description": "KV pages restored from the host every minute amount to {{ $value | humanize }} times the device "
                    "KV cache (5-minute rate): the running sequences' KV does not fit the device, so sequences keep "
                    "waiting to come back. Raise shard.numKvBlocks if the GPU has room, lower shard.numStateSlots, "
                    "or add shards; host KV is for bursts, not the steady state."},
]
assert {a["alert"] for a in ALERTS} >= {"KimiserveShardDown", "KimiserveNoHealthyShard", "KimiserveTTFTHigh"}


def _variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query, "refresh": 2, "sort": 1,
            "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}}


def dashboard() -> dict:
    panels, y, pid = [], 0, 1
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "title": row_title, "id": pid, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, (title, unit, targets, description) in enumerate(row_panels):
            panels.append({
                "type": "timeseries", "title": title, "description": description, "id": pid,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10}},
                                "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}},
                "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                            for j, (expr, legend) in enumerate(targets)],
            })
            pid += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    templating = [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        _variable("namespace", "Namespace", "label_values(kimiserve_router_queued_requests, namespace)"),
        _variable("model", "Model",
                  'label_values(kimiserve_router_queued_requests{namespace=~"$namespace"}, model)'),
    ]
    return {"title": "kimiserve", "uid": "kimiserve-overview", "description": "Router, shards, tokenizer and "
            "batch jobs of kimiserve (generated by helm/kimiserve/dashboards/generate.py)",
            "tags": ["kimiserve"], "editable": True, "schemaVersion": 39, "version": 1, "refresh": "30s",
            "time": {"from": "now-1h", "to": "now"}, "timezone": "browser", "graphTooltip": 1,
            "templating": {"list": templating}, "annotations": {"list": []}, "panels": panels}


def rules() -> dict:
    out = []
    for a in ALERTS:
        out.append({"alert": a["alert"], "expr": a["expr"], "for": a["for"],
                    "labels": {"severity": a["severity"]},
                    "annotations": {"summary": a["summary"], "description": a["description"]}})
    return {"groups": [{"name": "kimiserve", "rules": out}]}


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def rules_yaml() -> str:
    header = "# Generated by helm/kimiserve/dashboards/generate.py; do not edit by hand.\n"
    return header + yaml.safe_dump(rules(), sort_keys=False, width=120)


def panel_expressions() -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel."""
    return [(title, expr) for _, row in ROWS for title, _, targets, _ in row for expr, _ in targets]


if __name__ == "__main__":
    RULES.parent.mkdir(exist_ok=True)
    DASHBOARD.write_text(dashboard_json())
    RULES.write_text(rules_yaml())
    sys.stdout.write(f"wrote {DASHBOARD} and {RULES}\n")
