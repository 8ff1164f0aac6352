"""The shard's engine loop (engine thread + intake): bursts are packed into prefill passes, a bad sequence fails
alone, a loop that cannot continue fails every live request and reports itself, ids are unique, gauges are fresh."""

from __future__ import annotations

import logging
import queue
import threading

import pytest
import torch

from shard_svc.engine.sampling import SamplingParams
from shard_svc.errors import DuplicateRequest
from shard_svc.server.engine_loop import EngineLoop, ShuttingDown
from shard_svc.server.metrics import ShardMetrics
from tests.engine.conftest import linear_config, make_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class Events:
    """A sink per request: every TokenEvent, and the finish."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()

    def sink(self, event) -> None:
        self.q.put(event)

    def finish(self, timeout: float = 60.0):
        while True:
            event = self.q.get(timeout=timeout)
            if event.finish_reason is not None:
                return event


def _loop(**engine_kw) -> tuple[EngineLoop, list]:
    engine = make_engine(linear_config(), **engine_kw)
    passes: list = []
    step = engine.step

    def recording_step():
        result = step()
        passes.extend(result.passes)
        return result

    engine.step = recording_step
    loop = EngineLoop(engine, ShardMetrics("shard-test"))
    loop.start()
    return loop, passes


def _gauge(loop: EngineLoop, name: str) -> float:
    return loop.metrics.registry.get_sample_value(name, {"shard": "shard-test", "rank": "0"})


def test_requests_arriving_during_a_pass_are_prefilled_together():
    loop, passes = _loop(num_state_slots=8, prefill_token_budget=512)
    forward = loop.engine.runner.forward
    entered, release = threading.Event(), threading.Event()

    def held_forward(work, is_decode, points=None):
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return forward(work, is_decode, points)

    loop.engine.runner.forward = held_forward
    first = Events()
    loop.submit("first", list(range(1, 9)), GREEDY, first.sink)
    assert entered.wait(30)
    burst = {f"burst-{i}": Events() for i in range(5)}
    submitters = [threading.Thread(target=loop.submit, args=(rid, list(range(10 + i, 30 + i)), GREEDY, ev.sink))
                  for i, (rid, ev) in enumerate(burst.items())]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join(10)
    assert not any(t.is_alive() for t in submitters), "submit waited for the running pass"
    release.set()
    for ev in [first, *burst.values()]:
        assert ev.finish().finish_reason == "length"
    prefills = [p for p in passes if p.kind == "prefill"]
    assert prefills[0].request_ids == ["first"]
    assert sorted(prefills[1].request_ids) == sorted(burst), [p.request_ids for p in prefills]
    loop.stop(30)


def test_non_finite_logits_fail_only_that_sequence_and_the_loop_keeps_serving():
    loop, _ = _loop()
    forward = loop.engine.runner.forward

    def poisoned_forward(work, is_decode, points=None):
        logits = forward(work, is_decode, points)
        return [torch.full_like(rows, float("nan")) if seq.request_id == "poisoned" else rows
                for (seq, _), rows in zip(work, logits)]

    loop.engine.runner.forward = poisoned_forward
    good, bad = Events(), Events()
    loop.submit("good", [1, 2, 3], GREEDY, good.sink)
    loop.submit("poisoned", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0.7, seed=1), bad.sink)
    failed = bad.finish()
    assert failed.finish_reason == "error" and "poisoned" in failed.error and "NaN" in failed.error
    assert good.finish().finish_reason == "length"
    after = Events()
    loop.submit("after", [7, 8], GREEDY, after.sink)
    assert after.finish().completion_tokens == 4
    assert loop.failure is None
    loop.stop(30)


def test_a_step_that_raises_fails_every_live_request_and_runs_the_fatal_hooks():
    loop, _ = _loop()
    hooks: list[str] = []
    loop.fatal_hooks.append(hooks.append)

    def broken_schedule():
        raise RuntimeError("scheduler invariant broken")

    loop.engine.scheduler.schedule = broken_schedule
    a, b = Events(), Events()
    loop.submit("a", [1, 2, 3], GREEDY, a.sink)
    loop.submit("b", [4, 5], GREEDY, b.sink)
    for ev, prompt in ((a, 3), (b, 2)):
        done = ev.finish()
        assert done.finish_reason == "error" and "RuntimeError" in done.error
        assert done.prompt_tokens == prompt and done.completion_tokens == 0
    assert hooks and loop.failure is not None
    with pytest.raises(ShuttingDown):
        loop.submit("c", [1], GREEDY, Events().sink)


def test_duplicate_live_id_is_refused_and_the_first_request_is_untouched():
    loop, _ = _loop()
    first, second = Events(), Events()
    loop.submit("same", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), first.sink)
    with pytest.raises(DuplicateRequest):
        loop.submit("same", [9, 9], GREEDY, second.sink)
    done = first.finish()
    assert done.finish_reason == "length" and done.completion_tokens == 6
    assert second.q.empty()
    loop.submit("same", [9, 9], GREEDY, second.sink)  # the id is free again once the first finished
    assert second.finish().completion_tokens == 4
    loop.stop(30)


def test_cancel_frees_the_slot_and_the_gauges_show_it_without_another_pass():
    loop, _ = _loop()
    forward = loop.engine.runner.forward
    decoding = threading.Event()
    release = threading.Event()

    def slow_forward(work, is_decode, points=None):
        if is_decode:
            decoding.set()
            release.wait(0.05)
        return forward(work, is_decode, points)

    loop.engine.runner.forward = slow_forward
    ev = Events()
    loop.submit("long", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), ev.sink)
    assert decoding.wait(30)
    assert loop.cancel("long")
    assert ev.finish().finish_reason == "cancelled"
    release.set()
    deadline = threading.Event()
    for _ in range(100):
        if _gauge(loop, "kimiserve_shard_state_slots_used") == 0 and _gauge(
                loop, "kimiserve_shard_kv_blocks_used") == 0:
            break
        deadline.wait(0.05)
    assert _gauge(loop, "kimiserve_shard_state_slots_used") == 0
    assert _gauge(loop, "kimiserve_shard_kv_blocks_used") == 0
    assert not loop.cancel("long")
    loop.stop(30)


def test_warm_up_leaves_no_trace_in_pools_or_outputs():
    from shard_svc.engine.warmup import warm_up

    warmed, fresh = make_engine(linear_config(), num_state_slots=4, num_kv_blocks=32, kv_block_size=16,
                                prefill_token_budget=48), make_engine(linear_config(), num_state_slots=4,
                                                                      num_kv_blocks=32, kv_block_size=16,
                                                                      prefill_token_budget=48)
    summary = warm_up(warmed)
    assert summary["packed_lengths"] and 65 in summary["single_lengths"]  # 65 > budget: a chunked prompt ran
    s = warmed.scheduler
    assert not warmed.sequences and not s.running and not s.waiting
    assert s.slots.num_free == s.slots.num_slots and s.blocks.num_free == s.blocks.num_blocks
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert warmed.generate([3, 1, 4, 1, 5], params, "after").output == fresh.generate([3, 1, 4, 1, 5], params,
                                                                                        "after").output


def test_warm_up_runs_a_prompt_past_the_mla_prefills_key_workspace_where_the_context_allows():
    import dataclasses

    from shard_svc.engine.warmup import prompt_lengths, warm_up

    engine = make_engine(linear_config(), num_state_slots=4, num_kv_blocks=32, kv_block_size=16,
                         prefill_token_budget=48)
    assert 140 not in prompt_lengths(engine)  # the eager op expands every key at once: nothing to warm
    eager = engine.runner.ops.mla_prefill

    def attention(*args, **kwargs):
        return eager(*args, **kwargs)

    attention.context_workspace_tokens = 123  # a backend that merges launches past 123 keys
    engine.runner.ops = dataclasses.replace(engine.runner.ops, mla_prefill=attention)
    assert 140 in warm_up(engine)["single_lengths"]
    engine.max_model_len = 100
    assert 140 not in prompt_lengths(engine), "only where a request's context reaches it"


def test_warm_up_runs_with_the_prefix_cache_off_and_leaves_it_empty_and_on():
    """Snapshot points would split the warm-up's passes below the shapes it compiles; synthetic prompts must not
    become entries or count as snapshots."""
    from shard_svc.engine.warmup import warm_up

    engine = make_engine(linear_config(), num_state_slots=4, num_kv_blocks=64, kv_block_size=16,
                         prefill_token_budget=48, prefix_cache_entries=4, prefix_state_interval=16)
    cache = engine.prefix_cache
    warm_up(engine)
    assert engine.prefix_cache is cache and engine.scheduler.prefix_cache is cache
    assert len(cache) == 0 and cache.stats.inserted == 0 and cache.stats.queried_tokens == 0
    s = engine.scheduler
    assert s.slots.num_free == s.slots.num_slots and s.blocks.num_free == s.blocks.num_blocks
    prompt = list(range(1, 40))
    engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), "after")
    assert cache.stats.snapshots_interval == 2  # on again: the points at 16 and 32


def test_request_paths_warm_up_on_the_engine_thread_and_leave_a_fresh_shard(tmp_path):
    """EngineLoop.before_serving runs warm_request_paths on the engine thread (every sampling path, a format, a
    whole prompt from the prefix cache) before `ready`; the pools, the prefix cache and its metrics are then those
    of a fresh shard, and a request gets a fresh engine's tokens."""
    from kimiserve.tokenizer_files.tiny import write_tiny_tokenizer
    from shard_svc.engine.grammar import Grammars
    from shard_svc.engine.warmup import warm_request_paths

    write_tiny_tokenizer(tmp_path)
    raw = linear_config(vocab_size=1024, eos_token_id=514)
    kw = dict(num_state_slots=4, num_kv_blocks=64, prefix_cache_entries=4, prefix_state_interval=64)
    engine = make_engine(raw, grammars=Grammars.for_checkpoint(tmp_path, 1024, (514,)), **kw)
    threads, summary = [], {}

    def warm(e):
        threads.append(threading.current_thread().name)
        summary.update(warm_request_paths(e))

    loop = EngineLoop(engine, ShardMetrics("shard-test"))
    loop.before_serving = warm
    warm_stats = engine.prefix_cache.stats  # forget_prefixes gives the cache fresh counters after the warm-up
    loop.start()
    assert loop.ready.wait(60) and loop.failure is None
    assert threads == ["engine-loop"] and summary["paths"] == ["greedy", "json", "sampled", "unseeded"]
    assert summary["prefix_hit_tokens"] >= 2 * 48  # a prompt from the cache whole, then as the prefix of another
    # passes with a point inside (the kernels' segmented variants), one per length, each point taken mid-pass
    assert summary["snapshot_point_lengths"] and warm_stats.snapshots_message == len(summary["snapshot_point_lengths"])
    s, cache = engine.scheduler, engine.prefix_cache
    assert not engine.sequences and s.slots.num_free == s.slots.num_slots and s.blocks.num_free == s.blocks.num_blocks
    assert len(cache) == 0 and cache.stats.hit_tokens == 0 and cache.stats.queried_tokens == 0
    tokens = []
    loop.submit("after", [3, 1, 4, 1, 5], GREEDY, lambda e: tokens.append(e.token_id))
    loop.stop(30)  # drains: the request finishes first
    fresh = make_engine(raw, **kw).generate([3, 1, 4, 1, 5], GREEDY, "after").output
    assert [t for t in tokens if t is not None] == fresh
    assert loop.metrics.registry.get_sample_value("kimiserve_shard_prefix_cache_hit_tokens_total",
                                                  {"shard": "shard-test", "rank": "0"}) == 0


def test_each_prefill_pass_is_recorded_whole_and_each_request_timed():
    """The prefill pass record (metrics and one JSON log line per pass) and each request's timing agree with what
    the engine ran: a 16-token budget splits the 20-token prompt over passes that other prompts share."""
    loop, passes = _loop(num_state_slots=8, prefill_token_budget=16)
    handler, logger = _Capture(), logging.getLogger("shard_svc.engine.pass_record")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        prompts = {"short": list(range(1, 11)), "mid": list(range(20, 27)), "long": list(range(40, 60))}
        sinks = {rid: Events() for rid in prompts}
        for rid, ids in prompts.items():
            loop.submit(rid, ids, GREEDY, sinks[rid].sink)
        finals = {rid: ev.finish() for rid, ev in sinks.items()}
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        loop.stop(timeout=30)
    prefills = [p for p in passes if p.kind == "prefill"]
    lines = [r for r in handler.records if r.getMessage() == "prefill pass"]
    assert [line.request_ids for line in lines] == [p.request_ids for p in prefills]
    for line, p in zip(lines, prefills, strict=True):
        assert (line.seconds, line.sequences, line.tokens) == (round(p.seconds, 6), len(p.request_ids), p.tokens)
        assert (line.min_seq_tokens, line.max_seq_tokens) == (min(p.seq_tokens), max(p.seq_tokens))
        assert sum(p.seq_tokens) == p.tokens <= 16
        # one forward: the pass's prompt tokens (decodes ride in prefill passes only with --fold-decodes)
        assert line.decode_rows == p.decode_rows == 0
        assert line.graphed == 0 and not p.graphed  # the CPU has no CUDA graphs
        assert (line.chunks, line.max_chunk_tokens, line.rank, line.world_size) == (1, p.tokens + p.decode_rows, 0, 1)
    total = sum(len(ids) for ids in prompts.values())
    assert sum(p.tokens for p in prefills) == total

    def sample(name: str) -> float:
        return loop.metrics.registry.get_sample_value(name, {"shard": "shard-test", "rank": "0"})

    assert sample("kimiserve_shard_prefill_pass_tokens_sum") == total
    assert sample("kimiserve_shard_prefill_pass_seconds_count") == len(prefills)
    assert sample("kimiserve_shard_prefill_pass_sequences_sum") == sum(p.sequences for p in prefills)
    assert sample("kimiserve_shard_prefill_pass_chunks_sum") == len(prefills)
    assert sample("kimiserve_shard_prefill_pass_max_chunk_tokens_sum") == total
    assert sample("kimiserve_shard_prefill_pass_decode_rows_sum") == 0
    assert (sample("kimiserve_shard_prefill_pass_graphed_sum"), sample("kimiserve_shard_prefill_pass_graphed_count")) \
        == (0, len(prefills))
    assert sample("kimiserve_shard_decode_tokens_total") == 3 * len(prompts)  # every token after each first
    for name in ("request_queue_seconds", "request_wait_seconds", "request_prefill_seconds",
                 "time_to_first_token_seconds", "time_per_output_token_seconds", "request_duration_seconds"):
        assert sample(f"kimiserve_shard_{name}_count") == len(prompts), name
    decodes = [p for p in passes if p.kind == "decode"]
    assert sample("kimiserve_shard_decode_step_sequences_sum") == sum(p.sequences for p in decodes)
    assert sample("kimiserve_shard_request_prompt_tokens_sum") == total
    assert sample("kimiserve_shard_request_generation_tokens_sum") == 4 * len(prompts)

    for rid, final in finals.items():
        t = final.timing
        assert t.prefill_passes == sum(rid in p.request_ids for p in prefills) >= (2 if rid == "long" else 1)
        assert 0 <= t.queue_s <= t.wait_s <= t.time_to_first_token_s and 0 < t.prefill_s <= t.time_to_first_token_s
        assert t.wait_s + t.prefill_s == pytest.approx(t.time_to_first_token_s, abs=1e-6)
        assert t.time_to_first_token_s + t.decode_s == pytest.approx(t.duration_s, abs=1e-6)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_moving_drain_hands_over_the_movable_sequences_and_finishes_the_others():
    loop, _ = _loop()
    moves, stays = Events(), Events()
    loop.submit("moves", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), moves.sink,
                movable=True)
    loop.submit("stays", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), stays.sink)
    first = moves.q.get(timeout=60)
    assert first.token_id is not None and first.finish_reason is None
    loop.stop(60, move=True)
    moved, stayed = moves.finish(), stays.finish()
    assert (stayed.finish_reason, stayed.completion_tokens) == ("length", 40), "not movable: generated to its end"
    assert moved.finish_reason == "moved" and 3 < moved.moved_tokens < 3 + 400 and moved.state_bytes > 0
    packed = loop.exports.take("moves")
    assert packed.nbytes == moved.state_bytes and len(packed.tokens) == moved.moved_tokens
    assert packed.tokens[:3] == [1, 2, 3] and loop.exports.take("moves") is None, "handed out once"
    assert _gauge(loop, "kimiserve_shard_state_slots_used") == 0
    assert loop.metrics.registry.get_sample_value("kimiserve_shard_sequences_moved_total", {
        "shard": "shard-test", "rank": "0", "state": "exported"}) == 1
