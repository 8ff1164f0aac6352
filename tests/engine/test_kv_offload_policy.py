"""Host KV offload policy (scheduler.py): when the device's KV blocks run short, whole sequences move to the host and
wait, then come back; with a cache too small for every running sequence the tokens are those of a big cache."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.prefill_share import PrefillShare
from shard_svc.engine.sampling import SamplingParams
from shard_svc.engine.scheduler import Scheduler
from shard_svc.engine.sequence import Sequence
from shard_svc.ops import select_ops
from shard_svc.state.allocators import BlockAllocator, SlotAllocator
from shard_svc.state.kv_offload import HostKVProfile
from shard_svc.weight_streaming.metrics import StreamingMetrics
from tests.engine.conftest import k3_config, linear_config, random_model

BS = 4  # tokens per KV block


class FakeHost:
    """A host pool that only counts pages: offload frees the device blocks, restore takes fresh ones."""

    def __init__(self, blocks: BlockAllocator, num_pages: int):
        self.blocks, self.num_pages, self.held, self.calls = blocks, num_pages, {}, []

    def offload(self, owner: str) -> int:
        pages = len(self.blocks.table(owner))
        assert sum(self.held.values()) + pages <= self.num_pages, "the policy offloaded past the host pool"
        self.blocks.release(owner)
        self.held[owner] = pages
        self.calls.append(("offload", owner))
        return pages

    def restore(self, owner: str) -> int:
        pages = self.held.pop(owner)
        self.blocks.reserve(owner, pages * BS)
        self.calls.append(("restore", owner))
        return pages

    def drop(self, owner: str) -> int:
        self.calls.append(("drop", owner))
        return self.held.pop(owner)


def scheduler(num_blocks: int, host_pages: int, budget: int = 64, slots: int = 8) -> tuple[Scheduler, FakeHost]:
    blocks = BlockAllocator(num_blocks, BS)
    host = FakeHost(blocks, host_pages)
    # first come first served: these plans are about which sequences the offload moves, not how the budget is shared
    return Scheduler(SlotAllocator(slots), blocks, slots, PrefillShare(budget, "fcfs"), host), host


def running(s: Scheduler, rid: str, prompt: int, computed: int, max_tokens: int = 8) -> Sequence:
    """A sequence already admitted with `computed` tokens in its cache (as if earlier steps had run)."""
    seq = Sequence(rid, list(range(prompt)), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    seq.slot = s.slots.allocate(rid)
    seq.num_computed = computed
    seq.output = [0] * max(0, computed - prompt + 1) if computed >= prompt else []
    s.blocks.reserve(rid, computed)
    s.running.append(seq)
    return seq


def ids(plan) -> tuple[list[str], list[str]]:
    return [s.request_id for s, _ in plan.prefill], [s.request_id for s in plan.decode]


def test_sequences_off_the_step_go_first_then_the_newest():
    s, host = scheduler(num_blocks=8, host_pages=16, budget=4)
    running(s, "a", prompt=4, computed=4)  # decoding: its 5th token opens a block
    running(s, "b", prompt=16, computed=4)  # prefilling: the budget's 4 tokens open a block
    running(s, "c", prompt=16, computed=8)  # prefilling, past the budget this step, holding 2 blocks
    running(s, "d", prompt=8, computed=8)  # decoding, the newest
    assert s.blocks.num_free == 2  # and the step needs 3
    plan = s.schedule()
    assert s.offloaded == {"c": 2} and host.calls == [("offload", "c")]
    assert ids(plan) == (["b"], ["a", "d"])
    s2, host2 = scheduler(num_blocks=7, host_pages=16, budget=4)
    for rid, prompt, computed in (("a", 4, 4), ("b", 16, 4), ("d", 8, 8), ("e", 8, 8)):
        running(s2, rid, prompt, computed)
    assert ids(s2.schedule()) == (["b"], ["a", "d"]) and s2.offloaded == {"e": 2}  # all in the step: the newest


def test_offloaded_sequences_come_back_oldest_first_before_anything_new():
    s, host = scheduler(num_blocks=8, host_pages=16)
    for rid in "abc":
        running(s, rid, prompt=4, computed=8)  # each decoding, 2 blocks, its next token opening a third
    assert ids(s.schedule()) == ([], ["a", "b"]) and s.offloaded == {"c": 2}
    for seq in s.running[:2]:  # the step ran: a and b took their third block
        s.blocks.reserve(seq.request_id, 9)
        seq.num_computed = 9
    s.add(Sequence("new", [1, 2], SamplingParams(temperature=0.0, max_tokens=1)))
    assert ids(s.schedule()) == ([], ["a", "b"])  # c's 3 blocks do not fit in the 2 free: it waits, so does "new"
    assert s.offloaded == {"c": 2} and s.num_waiting == 1
    s.finish(s.running[0])  # a finishes: 3 blocks free
    assert ids(s.schedule()) == (["new"], ["b", "c"])  # c back first, then "new" beside the step
    assert s.offloaded == {} and host.calls[-1] == ("restore", "c") and s.num_waiting == 0


def test_a_sequence_finished_while_offloaded_frees_its_host_pages_and_slot():
    s, host = scheduler(num_blocks=4, host_pages=16)
    for rid in "ab":
        running(s, rid, prompt=4, computed=8)
    s.schedule()
    (victim,) = [q for q in s.running if q.request_id in s.offloaded]
    free_slots = s.slots.num_free
    s.finish(victim)
    assert host.calls[-1] == ("drop", victim.request_id) and not s.offloaded and s.slots.num_free == free_slots + 1


@pytest.mark.parametrize("host_pages,admitted", [(0, 2), (5, 2), (10, 3), (40, 4)])
def test_admission_promises_at_most_device_plus_host_minus_one_promise(host_pages, admitted):
    """10 blocks; each request promises 5 (8 prompt + 12 new tokens). Past the device's 10, the host must keep room
    for the largest promise: 5 host pages add nothing, 10 add one sequence."""
    blocks = BlockAllocator(10, BS)
    s = Scheduler(SlotAllocator(4), blocks, 4, PrefillShare(64, "fcfs"),
                  FakeHost(blocks, host_pages) if host_pages else None)
    for i in range(4):
        s.add(Sequence(f"r{i}", list(range(8)), SamplingParams(temperature=0.0, max_tokens=12)))
    s.schedule()
    assert len(s.running) == admitted


# -- the engine, end to end -------------------------------------------------------------------------------------------

CONFIGS = {"linear": linear_config(), "k3-93": k3_config(93)}
PROMPTS = [list(range(3, 12)), [40, 41, 42, 43, 44], list(range(100, 113)), [7, 9, 11, 13, 15, 17, 19]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def run(raw: dict, num_kv_blocks: int, host_pages: int = 0, registry: CollectorRegistry | None = None):
    cfg, model = random_model(raw, seed=1, dtype=torch.float64)
    page = HostKVProfile.from_config(cfg).page_bytes(BS, torch.float64)
    metrics = StreamingMetrics(registry, "kv") if registry is not None else None
    engine = Engine(cfg, model, select_ops(torch.device("cpu"), "eager"), torch.device("cpu"),
                    EngineConfig(num_state_slots=4, num_kv_blocks=num_kv_blocks, kv_block_size=BS,
                                 host_kv_bytes=host_pages * page), kv_metrics=metrics)
    seqs = [engine.add_request(f"r{i}", p, GREEDY, keep_prompt_logits=True) for i, p in enumerate(PROMPTS)]
    most, steps = 0, 0
    while engine.has_work():
        steps += 1
        assert steps < 200, "sequences stopped progressing (an offloaded sequence never came back?)"
        engine.step()
        resident = [q for q in engine.scheduler.running if q.request_id not in engine.scheduler.offloaded]
        most = max(most, len(resident))
    return seqs, most, engine


@pytest.mark.parametrize("name", ["linear", pytest.param("k3-93", marks=pytest.mark.slow)])
def test_a_cache_too_small_for_the_batch_gives_the_big_cache_tokens(name):
    """Promises of 7, 6, 8 and 6 blocks; 12 on the device hold one sequence's promise at a time without offload.
    With 23 host pages all four run together (27 <= 12 + 23 - 8) and the growing batch offloads and restores.
    k3-93: 24 MLA layers at engine indices 3, 7, ..., 91, 92, paged to the host by MLA cache index."""
    big, _, _ = run(CONFIGS[name], num_kv_blocks=64)
    registry = CollectorRegistry()
    small, most, engine = run(CONFIGS[name], num_kv_blocks=12, host_pages=23, registry=registry)
    assert most == 4
    for a, b in zip(big, small, strict=True):
        assert b.finish_reason == "length" and b.output == a.output, (a.request_id, a.output, b.output)
        torch.testing.assert_close(torch.cat(b.step_logits), torch.cat(a.step_logits), rtol=1e-9, atol=1e-9)
    value = lambda metric: registry.get_sample_value(metric, {"shard": "kv", "rank": "0"})  # noqa: E731
    assert value("kimiserve_kv_pages_offloaded_total") > 0
    assert value("kimiserve_kv_pages_restored_total") == value("kimiserve_kv_pages_offloaded_total")
    assert value("kimiserve_kv_host_pages") == 0 and engine.kv_offload.pages_on_host == 0
    assert engine.runner.kv_cache.blocks.num_free == 12 and engine.scheduler.slots.num_free == 4


def test_without_the_host_pool_the_small_cache_runs_one_sequence_at_a_time():
    """The control of the test above: its 12-block cache alone cannot batch the four prompts. Block counts follow
    from the prompts, block size and max_tokens, never the model's depth, so the cheap model checks it for both (a
    93-layer run of the four prompts one after another took most of that test's time)."""
    _, alone, _ = run(CONFIGS["linear"], num_kv_blocks=12)
    assert alone == 1


def test_cached_prefixes_give_their_blocks_back_before_a_sequence_is_offloaded_or_held():
    """With the prefix cache holding device blocks, the step must evict cached prefixes rather than offload
    running sequences (or keep offloaded ones waiting) for blocks nothing else will ever free."""
    big, _, _ = run(CONFIGS["linear"], num_kv_blocks=64)
    cfg, model = random_model(CONFIGS["linear"], seed=1, dtype=torch.float64)
    page = HostKVProfile.from_config(cfg).page_bytes(BS, torch.float64)
    engine = Engine(cfg, model, select_ops(torch.device("cpu"), "eager"), torch.device("cpu"),
                    EngineConfig(num_state_slots=4, num_kv_blocks=12, kv_block_size=BS, host_kv_bytes=23 * page,
                                 prefix_cache_entries=4))
    for i in range(2):
        engine.generate(list(range(30 + i, 47 + i)), SamplingParams(temperature=0.0, max_tokens=3,
                                                                    ignore_eos=True), f"fill-{i}")
    assert engine.prefix_cache.blocks_held >= 8
    seqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    steps = 0
    while engine.has_work():
        steps += 1
        assert steps < 200, "sequences stopped progressing behind blocks the prefix cache held"
        engine.step()
    assert [s.output for s in seqs] == [s.output for s in big]
