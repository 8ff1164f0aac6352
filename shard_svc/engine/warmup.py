"""Warm-up before a shard reports SERVING: every kind of pass the engine will run, once, on synthetic requests.

On a GPU the first pass of each shape compiles its Triton kernels (seconds each); a shard that reported SERVING
before that made its first users wait for the compiler (a 6 s first TTFT against 47 ms warm on the 48B shape).
The requests below cover a prefill of one sequence and of several packed ones, prompt lengths on and off the
kernels' 16- and 64-token tiles, a chunked prompt when the budget splits it, one longer than the MLA prefill's key
workspace where the context allows it, packed passes filling a quarter, half
and all of the prefill budget (kernels pick tiles by a pass's token count), and decode at batch 1 and at the
batches the packed rounds reach. Finished requests give back their slots and blocks, so the pools are as fresh as
before (a slot is zeroed when it is handed out). The prefix cache is off meanwhile: synthetic prompts have no place
among its entries or in its counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from shard_svc.engine.engine import Engine
from shard_svc.engine.grammar import ResponseFormat
from shard_svc.engine.prefill_share import CHUNK_ALIGN
from shard_svc.engine.prefix_cache import MIN_MESSAGE_GAP, PrefixCacheStats
from shard_svc.engine.sampling import SamplingParams
from shard_svc.engine.sequence import PrefixHints

log = logging.getLogger(__name__)
OUTPUT_TOKENS = 3


def prompt_lengths(engine: Engine) -> list[int]:
    """Lengths that fit one request's context and the KV cache, on and off the tiles, up to a chunked prompt, and
    one past the MLA prefill's key workspace (its attention then runs in merged launches: another kernel variant,
    met otherwise by the first prompt longer than it)."""
    longest = engine.max_model_len - OUTPUT_TOKENS
    budget = engine.engine_cfg.prefill_token_budget
    wanted = {1, 15, 16, 63, 64, 65, 1000, 1024, budget, budget + 17}
    workspace = int(getattr(engine.runner.ops.mla_prefill, "context_workspace_tokens", 0))
    if workspace:
        wanted.add(workspace + 17)
    return sorted(n for n in wanted if 1 <= n <= longest)


def packed_rounds(engine: Engine) -> list[list[int]]:
    """Prompt lengths of packed passes that fill a quarter, half and all of the prefill budget (kernels choose
    tiles by the pass's token count), with as many sequences as the running slots allow."""
    longest = engine.max_model_len - OUTPUT_TOKENS
    budget = engine.engine_cfg.prefill_token_budget
    rounds = []
    for total in sorted({max(1, budget // 4), max(1, budget // 2), budget}):
        length = min(longest, total, 1024)
        count = max(1, min(engine.scheduler.max_running, total // length))
        rounds.append([length] * count)
    return rounds


@contextmanager
def _prefix_cache_off(engine: Engine) -> Iterator[None]:
    cache = engine.prefix_cache
    engine.prefix_cache = engine.scheduler.prefix_cache = None
    try:
        yield
    finally:
        engine.prefix_cache = engine.scheduler.prefix_cache = cache


def warm_up(engine: Engine) -> dict:
    """Runs the warm-up requests to completion, with the prefix cache off; returns what ran (for the log)."""
    with _prefix_cache_off(engine):
        return _run(engine)


def _run(engine: Engine) -> dict:
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    lengths = prompt_lengths(engine)
    for n in lengths:  # one at a time: single-sequence prefill (chunked where n > budget), decode at batch 1
        engine.generate([(7 * i) % 97 + 1 for i in range(n)], params, request_id=f"warmup-single-{n}")
    fits = engine.engine_cfg.num_kv_blocks * engine.engine_cfg.kv_block_size
    together = [n for n in lengths if n <= engine.engine_cfg.prefill_token_budget]
    while sum(n + OUTPUT_TOKENS for n in together) > fits // 2 and len(together) > 1:
        together.pop()
    steps = 0
    for r, round_lengths in enumerate([together, *packed_rounds(engine)]):
        for k, n in enumerate(round_lengths):  # all at once: packed prefill passes, decode at the batch they reach
            engine.add_request(f"warmup-packed-{r}-{k}", [(5 * i + r + k) % 89 + 1 for i in range(n)], params)
        while engine.has_work():
            engine.step()
            steps += 1
    summary = {"seconds": round(time.perf_counter() - start, 3), "single_lengths": lengths,
               "packed_lengths": together, "packed_steps": steps}
    log.info("engine warmed up", extra=summary)
    return summary


def forget_prefixes(engine: Engine) -> None:
    """Empties the prefix cache of the warm-up's prompts and zeroes its counters: users meet the cache, and its
    metrics, a fresh shard has. Before the engine loop first publishes the counters (they only ever advance)."""
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
        engine.prefix_cache.stats = PrefixCacheStats()


def request_path_params(engine: Engine) -> dict[str, SamplingParams]:
    """One request of each sampling path a first user request may take: greedy; seeded temperature with top-k,
    top-p, the three penalties and top logprobs; unseeded temperature; and a response_format where the shard can
    enforce one."""
    params = {"greedy": SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True),
              "sampled": SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1, max_tokens=OUTPUT_TOKENS,
                                        ignore_eos=True, logprobs=True, top_logprobs=5, presence_penalty=0.1,
                                        frequency_penalty=0.1, repetition_penalty=1.1),
              "unseeded": SamplingParams(temperature=1.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)}
    if engine.grammars is not None and engine.grammars.refusal is None:
        params["json"] = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS,
                                        response_format=ResponseFormat("json_object"))
    return params


def warm_request_paths(engine: Engine) -> dict:
    """Runs on the engine loop's own thread before the shard reports SERVING (EngineLoop.before_serving).

    `warm_up` compiles every pass shape, but on the thread that built the engine; what a library creates per thread
    (a cuBLAS handle and workspace, a device generator's first kernels) and what loads on first use (sampling,
    penalty and grammar-mask kernels) the first user request would still pay on the engine thread. This runs each
    sampling path, packed, then the prefix cache's hit paths and passes with snapshot points inside, then forgets
    the prefixes it cached."""
    start = time.perf_counter()
    prompt = [(11 * i) % 89 + 1 for i in range(min(48, engine.max_model_len - OUTPUT_TOKENS))]
    params = request_path_params(engine)
    steps = 0
    for name, p in params.items():  # packed: the passes mix the paths, as a burst of users would
        engine.add_request(f"warmup-path-{name}", list(prompt), p)
    while engine.has_work():
        engine.step()
        steps += 1
    # The prefix cache's paths, one request at a time: a new prompt, the same prompt (cached whole: its first token
    # from the cached logits row, sampled), then a longer one (a cached prefix restored, the rest prefilled).
    other = [(13 * i) % 83 + 2 for i in range(len(prompt))]
    tail = [(17 * i) % 79 + 3 for i in range(8)]  # the longer prompt's new tokens after the cached `other`
    for k, ids in enumerate((other, other, other + tail)):
        if len(ids) + OUTPUT_TOKENS <= engine.max_model_len:
            engine.generate(ids, params["sampled"], request_id=f"warmup-prefix-{k}")
    hits = engine.prefix_cache.stats.hit_tokens if engine.prefix_cache is not None else 0
    pointed = _passes_with_points(engine, params["greedy"])
    forget_prefixes(engine)
    summary = {"seconds": round(time.perf_counter() - start, 3), "paths": sorted(params), "steps": steps,
               "prefix_hit_tokens": hits, "snapshot_point_lengths": pointed}
    log.info("request paths warmed on the engine thread", extra=summary)
    return summary


def _passes_with_points(engine: Engine, params: SamplingParams) -> list[int]:
    """Prompts of `prompt_lengths` with a message point inside their pass (and the interval's points where they are
    long enough): the KDA kernels' segmented variants and the point rows' logits compile per pass shape, which
    `warm_up` (cache off) never ran; without this a fresh shard's first chat paid 0.9 s and its first 8k document
    3.3 s more than with the cache off (H200, 48B shape, 2026-12-06). Returns the lengths run."""
    if engine.prefix_cache is None:
        return []
    point = 2 * CHUNK_ALIGN
    lengths = [n for n in prompt_lengths(engine) if n >= point + MIN_MESSAGE_GAP]
    for n in lengths:  # a salt per length: no prompt restores another's start, so each pass takes its point
        engine.generate([(19 * i) % 73 + 4 for i in range(n)], params, request_id=f"warmup-points-{n}",
                        prefix=PrefixHints(salt=f"warmup-{n}", boundaries=(point,)))
    return lengths
