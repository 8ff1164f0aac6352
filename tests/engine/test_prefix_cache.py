"""The prefix cache is exact: every request gives the tokens an engine without a cache gives (float32, both model
families), at every boundary: a prefix equal to an entry, one token shorter or longer, ending inside a KV block or
on its edge, a whole prompt cached (max_tokens=1 too), interval snapshots inside a chunked prefill, the next turn of
a conversation, sequences sharing blocks while their entry is evicted; an evicted entry is never read. With the host
tier: hits that come back from the host (as a prefix and whole), an entry dropped from the host (never read again),
an admission that pushes its own hit to the host, and the host bytes accounted exactly. Combined once each with
K3's block attention residuals (FAMILIES), weight streaming and host KV offload."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.prefill_share import CHUNK_ALIGN
from shard_svc.engine.prefix_cache import MAX_MESSAGE_POINTS, MIN_MESSAGE_GAP, PrefixCache
from shard_svc.engine.prefix_host import PrefixHostConfigError
from shard_svc.engine.sampling import SamplingParams
from shard_svc.engine.sequence import PrefixHints
from shard_svc.errors import InvalidRequest
from shard_svc.ops import select_ops
from shard_svc.state.kv_offload import HostKVProfile
from shard_svc.weight_streaming.metrics import StreamingMetrics
from tests.engine.conftest import k3_config, linear_config, make_engine, random_model

CPU = torch.device("cpu")

BLOCK = 16
FAMILIES = {"kimi_linear": linear_config(), "kimi_k3": k3_config(layers=5)}


def _engines(raw: dict, **kw):
    common = dict(num_state_slots=4, num_kv_blocks=kw.pop("blocks", 96), kv_block_size=BLOCK,
                  prefill_token_budget=kw.pop("budget", 64))
    cached = make_engine(raw, prefix_cache_entries=kw.pop("entries", 4), **common, **kw)
    plain = make_engine(raw, **common)
    return cached, plain


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (n,), generator=g).tolist()


def _run(engine, prompt, rid, max_tokens=6, temperature=0.0, prefix=PrefixHints(), **sampling):
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, **sampling)
    seq = engine.add_request(rid, prompt, params, prefix=prefix)
    while not seq.finished:
        engine.step()
    return seq.output, seq.cached_tokens


def _pools_settle(engine) -> None:
    engine.prefix_cache.clear()
    s = engine.scheduler
    assert s.slots.num_free == s.slots.num_slots and s.blocks.num_free == s.blocks.num_blocks


@pytest.mark.parametrize("family,length", [("kimi_linear", 32), ("kimi_linear", 37), ("kimi_k3", 37)])
def test_boundaries_around_a_cached_prompt(family, length):  # an entry ending on a block edge, inside a block
    cached, plain = _engines(FAMILIES[family])
    base = _prompt(length, 1)
    assert _run(cached, base, "a") == (_run(plain, base, "a")[0], 0)
    cases = {"equal": base, "one_shorter": base[:-1], "one_longer": base + [7], "longer": base + _prompt(9, 2),
             "diverges_inside": base[:length - 3] + [3, 4, 5, 6]}
    for i, (name, prompt) in enumerate(cases.items()):
        want, _ = _run(plain, prompt, f"{name}-{i}")
        got, hit = _run(cached, prompt, f"{name}-{i}", temperature=0.0)
        assert got == want, name
        if name in ("equal", "one_longer", "longer"):
            assert hit == length, name  # the prompt-end entry of `base` (or longer, after its own finish)
    _pools_settle(cached)


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_prompt_cached_with_max_tokens_one_and_sampling(family):
    cached, plain = _engines(FAMILIES[family])
    prompt = _prompt(40, 3)
    _run(cached, prompt, "warm", max_tokens=1)
    for rid, kw in (("greedy-1", dict(max_tokens=1)), ("seeded", dict(temperature=0.8, seed=11, max_tokens=8))):
        want, _ = _run(plain, prompt, rid, **kw)
        got, hit = _run(cached, prompt, rid, **kw)
        assert (got, hit) == (want, 40), rid
    _pools_settle(cached)


@pytest.mark.parametrize("family", FAMILIES)
def test_next_turn_hits_the_finished_conversation(family):
    cached, plain = _engines(FAMILIES[family])
    turn1 = _prompt(30, 4)
    out1, _ = _run(cached, turn1, "t1", max_tokens=10)
    turn2 = turn1 + out1 + _prompt(12, 5)
    want, _ = _run(plain, turn2, "t2", max_tokens=10)
    got, hit = _run(cached, turn2, "t2", max_tokens=10)
    assert got == want and hit == 30 + 10 - 1  # prompt + output, but the last token, which was never fed back
    _pools_settle(cached)


@pytest.mark.parametrize("family", FAMILIES)
def test_interval_snapshots_inside_a_chunked_prefill(family):
    cached, plain = _engines(FAMILIES[family], budget=BLOCK, prefix_state_interval=32, entries=6)
    long = _prompt(100, 6)
    _run(cached, long, "long")
    other = long[:70] + _prompt(20, 7)  # shares 70 tokens: the snapshot at 64 is the longest that fits
    want, _ = _run(plain, other, "other")
    got, hit = _run(cached, other, "other")
    assert got == want and hit == 64
    _pools_settle(cached)


# -- snapshot points: message boundaries, the interval, salts, the value policy ----------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_a_message_boundary_inside_a_pass_is_snapshotted_on_the_chunk_grid_and_restored(family):
    """A boundary at 70 (inside a KDA chunk) in a 150-token prompt, with a budget that prefills it all in one pass:
    the pass stays whole and writes the state out at 64, the chunk line below the boundary, so the prompt's own
    state is bit for bit that of an engine that took no point (a cut at 70 regroups the chunks after it: the H200
    run of 2026-12-06 flipped the first reply token at the 48B shape in bf16); a prompt sharing the 70 tokens
    restores 64 of them, with the tokens of an engine without a cache."""
    cached, plain = _engines(FAMILIES[family], budget=512, blocks=128)
    unhinted, _ = _engines(FAMILIES[family], budget=512, blocks=128, prefix_state_interval=0)
    system = _prompt(70, 40)
    first = system + _prompt(80, 41)
    seq = cached.add_request("first", first, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                             prefix=PrefixHints(boundaries=(70,)))
    step = cached.step()
    assert [p.seq_tokens for p in step.passes if p.kind == "prefill"] == [[150]]
    while not seq.finished:
        cached.step()
    assert cached.prefix_cache.stats.snapshots_message == 1
    _run(unhinted, first, "first", max_tokens=3)
    # The recurrent states at the prompt's end (its logits row shares a product with the point's row, which the
    # CPU's BLAS rounds differently from a single row).
    states = [e.runner.kda_pool.recurrent[:, e.prefix_cache.lookup(first).slot] for e in (cached, unhinted)]
    assert torch.equal(*states)
    second = system + _prompt(50, 42)
    want, _ = _run(plain, second, "second")
    assert _run(cached, second, "second") == (want, CHUNK_ALIGN)
    _pools_settle(cached)
    _pools_settle(unhinted)


def test_a_failed_pass_gives_the_slots_claimed_for_its_points_back():
    cached, _ = _engines(FAMILIES["kimi_linear"], budget=512, blocks=128)
    forward, carried = cached.runner.forward, []

    def failing(work, is_decode, points=None):
        carried.append(points)
        raise RuntimeError("device fault")

    cached.runner.forward = failing
    seq = cached.add_request("first", _prompt(70, 40) + _prompt(80, 41),
                             SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                             prefix=PrefixHints(boundaries=(70,)))
    cached.step()
    assert seq.finish_reason == "error" and carried and carried[0]["first"][0][0] == CHUNK_ALIGN
    assert len(cached.prefix_cache) == 0
    cached.runner.forward = forward
    _pools_settle(cached)


def test_salts_keep_entries_apart():
    cached, plain = _engines(FAMILIES["kimi_linear"])
    prompt = _prompt(40, 43)
    want, _ = _run(plain, prompt, "p", max_tokens=1)
    assert _run(cached, prompt, "a1", max_tokens=1, prefix=PrefixHints("tenant-a")) == (want, 0)
    assert _run(cached, prompt, "b1", max_tokens=1, prefix=PrefixHints("tenant-b")) == (want, 0)
    assert _run(cached, prompt, "none", max_tokens=1) == (want, 0)
    assert _run(cached, prompt, "a2", max_tokens=1, prefix=PrefixHints("tenant-a")) == (want, 40)
    assert _run(cached, prompt, "b2", max_tokens=1, prefix=PrefixHints("tenant-b")) == (want, 40)
    _pools_settle(cached)


def test_an_entry_restored_often_outlives_newer_unused_ones():
    """Two entries: `hot` restored twice, then `cold` made, then `new`. By recency `hot` would go (least recently
    used); by value (hits x length) `cold` goes."""
    cached, _ = _engines(FAMILIES["kimi_linear"], entries=2)
    hot, cold, new = _prompt(40, 44), _prompt(40, 45), _prompt(40, 46)
    for rid in ("hot-0", "hot-1", "hot-2"):
        _run(cached, hot, rid, max_tokens=1)
    _run(cached, cold, "cold", max_tokens=1)
    _run(cached, new, "new", max_tokens=1)
    cache = cached.prefix_cache
    assert cache.lookup(hot) is not None and cache.lookup(cold) is None and cache.lookup(new) is not None
    assert cache.stats.evictions == 1
    _pools_settle(cached)


def test_message_points_keep_the_first_and_last_of_those_far_enough_apart_and_from_the_end():
    g = MIN_MESSAGE_GAP
    assert g == CHUNK_ALIGN  # the cases below use one width for both
    assert PrefixCache.message_points("r", [g - 1, g, g + 5, 2 * g, 5 * g], 6 * g) == (g, 2 * g, 5 * g)
    # the last: too near the end; 3g - 9 moves down to the chunk line 2g
    assert PrefixCache.message_points("r", [g, 3 * g - 9, 3 * g - 5], 3 * g) == (g, 2 * g)
    assert PrefixCache.message_points("r", [g + 5, g + 50], 4 * g) == (g,)  # both on the line g: one point
    assert PrefixCache.message_points("r", [g, 3 * g - 9], 3 * g) == (g,)
    many = [g * (i + 1) for i in range(10)]
    half = MAX_MESSAGE_POINTS // 2
    assert PrefixCache.message_points("r", many, 11 * g) == tuple(many[:half] + many[-half:])


@pytest.mark.parametrize("bad", [[0], [5, 5], [9, 3], [40]])
def test_boundaries_outside_the_prompt_or_not_increasing_are_refused(bad):
    cached, _ = _engines(FAMILIES["kimi_linear"])
    with pytest.raises(InvalidRequest, match="message boundary .* prompt's length"):
        cached.add_request("bad", _prompt(40, 47), SamplingParams(max_tokens=2), prefix=PrefixHints(boundaries=bad))
    assert not cached.has_work()


def test_interval_snapshots_land_exactly_on_multiples_whatever_the_budget():
    cached, plain = _engines(FAMILIES["kimi_linear"], budget=50, prefix_state_interval=32, entries=6)
    long = _prompt(100, 48)
    _run(cached, long, "long", max_tokens=1)
    assert cached.prefix_cache.stats.snapshots_interval == 3  # 32, 64, 96
    other = long[:97] + _prompt(5, 49)
    assert _run(cached, other, "other") == (_run(plain, other, "other")[0], 96)
    _pools_settle(cached)


def test_sequences_sharing_blocks_survive_the_eviction_of_their_entry():
    cached, plain = _engines(FAMILIES["kimi_linear"], entries=1)
    shared = _prompt(48, 8)
    _run(cached, shared, "seed", max_tokens=1)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = {f"s{i}": shared + _prompt(5 + i, 20 + i) for i in range(2)}
    seqs = {rid: cached.add_request(rid, p, params) for rid, p in prompts.items()}
    cached.step()  # both admitted and restored from the entry of `shared`
    assert all(s.cached_tokens == 48 for s in seqs.values())
    shared_block = cached.scheduler.blocks.table("s0")[0]
    assert cached.scheduler.blocks.refs(shared_block) == 3  # the entry and both sequences
    cached.prefix_cache.clear()  # evicted while both still run on its blocks
    assert cached.scheduler.blocks.refs(shared_block) == 2
    while cached.has_work():
        cached.step()
    for rid, p in prompts.items():
        assert seqs[rid].output == _run(plain, p, rid, max_tokens=12)[0], rid
    _pools_settle(cached)


def test_an_evicted_entry_is_never_read():
    cached, plain = _engines(FAMILIES["kimi_linear"], entries=1)
    first, second = _prompt(33, 9), _prompt(33, 10)
    _run(cached, first, "first", max_tokens=1)
    entry = cached.prefix_cache.lookup(first)
    slot, blocks = entry.slot, list(cached.scheduler.blocks.table(entry.owner))
    _run(cached, second, "second", max_tokens=1)  # one entry: `first` is evicted
    assert cached.prefix_cache.lookup(first) is None
    pool, kv = cached.runner.kda_pool, cached.runner.kv_cache
    pool.recurrent[:, slot] = float("nan")  # what a stale read would see
    pool.conv[:, slot] = float("nan")
    for b in blocks:
        if cached.scheduler.blocks.refs(b) == 0:
            kv.kv[:, b] = float("nan")
    got, hit = _run(cached, first, "again")
    assert hit == 0 and got == _run(plain, first, "again")[0]


def test_admission_evicts_cached_prefixes_for_kv_blocks():
    cached, _ = _engines(FAMILIES["kimi_linear"], entries=4, blocks=24)
    for i in range(4):
        _run(cached, _prompt(60, 30 + i), f"fill-{i}", max_tokens=1)
    assert cached.prefix_cache.blocks_held >= 12 and cached.scheduler.blocks.num_free <= 12
    big = _prompt(24 * BLOCK - 20, 50)  # needs nearly every block: the entries must give theirs back
    out, _ = _run(cached, big, "big", max_tokens=4)
    assert len(out) == 4 and cached.prefix_cache.stats.evictions >= 1


def test_a_snapshot_with_every_slot_taken_evicts_instead_of_failing():
    """A slot held outside the scheduler's count (CUDA graphs' padding slot, on a GPU) leaves running + entries one
    short of the pool: a prompt-end snapshot then takes an entry's slot instead of raising."""
    cached, plain = _engines(FAMILIES["kimi_linear"], entries=4)  # 4 running + 4 entries: 8 slots
    cached.runner.kda_pool.slots.allocate("<held elsewhere>")
    for i in range(2):
        _run(cached, _prompt(20, 60 + i), f"fill-{i}", max_tokens=1)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = {f"r{i}": _prompt(24, 70 + i) for i in range(4)}  # 4 running + 2 entries + 1 held: one slot free
    seqs = {rid: cached.add_request(rid, p, params) for rid, p in prompts.items()}
    while cached.has_work():
        cached.step()
    for rid, p in prompts.items():
        assert seqs[rid].output == _run(plain, p, rid, max_tokens=5)[0], rid


# -- host tier (--prefix-host-entries) ------------------------------------------------------------------------------

def _host_bytes(engine, length: int) -> int:
    """What one host entry of `length` tokens must hold: a state slot, every KV block of the prefix, a logits row."""
    kv = engine.runner.kv_cache.kv
    block = kv[:, 0].numel() * kv.element_size()
    return (engine.runner.kda_pool.bytes_per_slot + -(-length // BLOCK) * block
            + engine.cfg.vocab_size * 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hit_from_the_host_tier_equals_no_cache(family):
    """One device entry, two on the host: an evicted prompt comes back from the host as a prefix (a longer prompt)
    and whole (its first token drawn from the host logits row, greedy and seeded), tokens as without a cache."""
    cached, plain = _engines(FAMILIES[family], entries=1, prefix_host_entries=2)
    cache = cached.prefix_cache
    a, b = _prompt(37, 11), _prompt(21, 12)
    _run(cached, a, "a", max_tokens=1)  # max_tokens=1: the finish adds no entry (prompt-end entry covers it)
    _run(cached, b, "b", max_tokens=1)  # `a` goes to the host
    assert (len(cache), cache.host_entries) == (1, 1)
    assert cache.host_bytes == _host_bytes(cached, 37)
    longer = a + _prompt(9, 13)
    got, hit = _run(cached, longer, "longer")
    assert (got, hit) == (_run(plain, longer, "longer")[0], 37)
    assert cache.stats.host_hit_tokens == 37
    for rid, kw in (("whole-greedy", dict(max_tokens=1)), ("whole-seeded", dict(temperature=0.8, seed=5))):
        c2, p2 = _engines(FAMILIES[family], entries=1, prefix_host_entries=2)
        _run(c2, a, "a", max_tokens=1)
        _run(c2, b, "b", max_tokens=1)
        got, hit = _run(c2, a, rid, **kw)
        assert (got, hit) == (_run(p2, a, rid, **kw)[0], 37), rid
        assert c2.prefix_cache.stats.host_hit_tokens == 37
        _pools_settle(c2)
    _pools_settle(cached)
    assert cache.host_entries == 0 and cache.host_bytes == 0


def test_an_entry_dropped_from_the_host_tier_is_gone_for_good():
    cached, plain = _engines(FAMILIES["kimi_linear"], entries=1, prefix_host_entries=1)
    cache = cached.prefix_cache
    first, second, third = _prompt(33, 14), _prompt(40, 15), _prompt(18, 16)
    _run(cached, first, "first", max_tokens=1)
    _run(cached, second, "second", max_tokens=1)  # `first` to the host
    dropped = cache.lookup(first)
    assert cache.host_entries == 1 and dropped is not None and not cache.shared_blocks(dropped)
    _run(cached, third, "third", max_tokens=1)  # `second` to the host: `first` is dropped from it
    assert cache.lookup(first) is None and cache.stats.host_evictions == 1 and cache.stats.evictions == 2
    assert cache.host_entries == 1 and cache.host_bytes == _host_bytes(cached, 40)
    for t in (*dropped.state.parts().values(), dropped.logits):
        t.fill_(float("nan"))  # what a read of the dropped entry would see
    got, hit = _run(cached, first, "again")
    assert hit == 0 and got == _run(plain, first, "again")[0]
    assert cache.stats.host_hit_tokens == 0
    _pools_settle(cached)


def test_an_admission_that_evicts_its_own_hit_restores_it_from_the_host():
    """The hit's device entry must give its blocks back for the admission: it goes to the host, and the sequence
    restores it from there (into fresh blocks of its own) instead of prefilling the prefix again."""
    cached, plain = _engines(FAMILIES["kimi_linear"], entries=4, blocks=24, prefix_host_entries=4)
    head = _prompt(60, 17)  # 4 blocks: 3 full (shared by a device hit) and one partial
    _run(cached, head, "head", max_tokens=1)
    for i in range(2):
        _run(cached, _prompt(40, 18 + i), f"fill-{i}", max_tokens=1)
    long = head + _prompt(300, 20)  # 360 + 10 tokens: 24 blocks, the whole cache; 21 with the hit's 3 shared
    got, hit = _run(cached, long, "long", max_tokens=10)
    assert hit == 60 and cached.prefix_cache.stats.host_hit_tokens == 60
    assert got == _run(plain, long, "long", max_tokens=10)[0]
    _pools_settle(cached)


def test_a_host_tier_without_the_prefix_cache_is_refused():
    with pytest.raises(PrefixHostConfigError, match="3 entries needs the prefix cache on"):
        make_engine(FAMILIES["kimi_linear"], prefix_host_entries=3)


def test_a_hash_collision_displaces_the_old_entry_and_frees_its_slot_and_blocks(monkeypatch):
    """Every block chain made to hash alike: two prompts of one length with the same tail share a key. The second
    entry displaces the first (whose slot and blocks go back to the pools), and the first is never restored."""
    import shard_svc.engine.prefix_cache as prefix_cache

    monkeypatch.setattr(prefix_cache, "hash", lambda _: 0, raising=False)
    cached, plain = _engines(FAMILIES["kimi_linear"], entries=4)
    first, second = _prompt(32, 21), _prompt(32, 22)  # two full blocks each, no tail: the same key
    _run(cached, first, "first", max_tokens=1)
    _run(cached, second, "second", max_tokens=1)
    assert len(cached.prefix_cache) == 1 and cached.prefix_cache.lookup(first) is None
    got, hit = _run(cached, first, "again", max_tokens=3)
    assert hit == 0 and got == _run(plain, first, "again", max_tokens=3)[0]
    _pools_settle(cached)


# -- with the other memory features: weight streaming, host KV offload (K3 is in FAMILIES above) --------------------

def test_streamed_weights_with_the_cache_and_its_host_tier():
    """Layers streamed from host memory through the device ring: hits from the host tier and from the device give
    the tokens of resident weights without a cache."""
    from shard_svc.weight_streaming import StreamOptions, WeightStreamer
    from shard_svc.weight_streaming.host import HostWeights

    raw = FAMILIES["kimi_linear"]
    cfg, model = random_model(raw, seed=0)
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU,
                    EngineConfig(num_state_slots=4, num_kv_blocks=96, kv_block_size=BLOCK, prefill_token_budget=64,
                                 prefix_cache_entries=1, prefix_host_entries=2))
    streamer = WeightStreamer(cfg, model, HostWeights.from_model(cfg, model), CPU, StreamOptions(prefetch_depth=2))
    streamer.attach(engine.runner)
    plain = make_engine(raw, num_state_slots=4, num_kv_blocks=96, kv_block_size=BLOCK, prefill_token_budget=64)
    a, b = _prompt(37, 23), _prompt(21, 24)
    _run(engine, a, "a", max_tokens=1)
    _run(engine, b, "b", max_tokens=1)  # `a` to the host
    longer = a + _prompt(9, 25)
    out, hit = _run(engine, longer, "longer")
    assert (out, hit) == (_run(plain, longer, "longer")[0], 37)  # from the host tier
    turn2 = longer + out + _prompt(5, 26)
    assert _run(engine, turn2, "turn2") == (_run(plain, turn2, "turn2")[0], 46 + 6 - 1)  # the finished conversation
    assert engine.prefix_cache.stats.host_hit_tokens == 37 and streamer.last_pass.bytes > 0
    _pools_settle(engine)


def test_host_kv_offload_with_prefix_hits_from_the_host_tier():
    """A device KV cache of 12 blocks of 4 tokens and host pages for the rest: four sequences restoring one cached
    prefix from the host tier (each into fresh blocks), run together while whole sequences' KV moves to the host
    and back; tokens as a big cache without a prefix cache."""
    bs = 4
    cfg, model = random_model(FAMILIES["kimi_linear"], seed=1)
    page = HostKVProfile.from_config(cfg).page_bytes(bs, torch.float32)
    registry = CollectorRegistry()
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU,
                    EngineConfig(num_state_slots=4, num_kv_blocks=12, kv_block_size=bs, host_kv_bytes=23 * page,
                                 prefix_cache_entries=1, prefix_host_entries=8),
                    kv_metrics=StreamingMetrics(registry, "kv"))
    plain = make_engine(FAMILIES["kimi_linear"], seed=1, num_state_slots=4, num_kv_blocks=64, kv_block_size=bs)
    head = _prompt(10, 27)
    _run(engine, head, "head", max_tokens=1)
    _run(engine, _prompt(9, 28), "other", max_tokens=1)  # `head` to the host
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {f"r{i}": head + _prompt(3 + i % 3, 30 + i) for i in range(4)}
    seqs = {rid: engine.add_request(rid, p, params) for rid, p in prompts.items()}
    while engine.has_work():
        engine.step()
    for rid, p in prompts.items():
        assert (seqs[rid].output, seqs[rid].cached_tokens) == (_run(plain, p, rid, max_tokens=8)[0], 10), rid
    offloaded = registry.get_sample_value("kimiserve_kv_pages_offloaded_total", {"shard": "kv", "rank": "0"})
    assert offloaded and offloaded == registry.get_sample_value("kimiserve_kv_pages_restored_total",
                                                                {"shard": "kv", "rank": "0"})
    assert engine.prefix_cache.stats.host_hit_tokens == 40
    _pools_settle(engine)


def test_interval_points_thin_out_with_the_position():
    """Interval 16: points every 16 tokens below 256 (16 x interval), every 32 below 512, every 64 below 1024; a
    prompt sharing 500 tokens of a cached 600-token one restores the point at 480."""
    cached, plain = _engines(FAMILIES["kimi_linear"], budget=512, blocks=128, prefix_state_interval=BLOCK, entries=30)
    long = _prompt(600, 50)
    _run(cached, long, "long", max_tokens=1)
    points = [*range(16, 256, 16), *range(256, 512, 32), 512, 576]
    assert cached.prefix_cache.stats.snapshots_interval == len(points) == 25
    other = long[:500] + _prompt(20, 51)
    assert _run(cached, other, "other") == (_run(plain, other, "other")[0], 480)
    _pools_settle(cached)
