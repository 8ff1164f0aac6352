"""Engine invariants on tiny random models: state carried across passes must equal recomputation."""

import pytest
import torch

from shard_svc.engine.sampling import SamplingParams
from tests.engine.conftest import k3_config, linear_config, make_engine

CONFIGS = {"linear": linear_config(), "linear-mla-first": linear_config(
    linear_attn_config={"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [2, 3, 4],
                        "full_attn_layers": [1]}), "k3-26": k3_config(26)}
F64 = torch.float64
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def assert_logits_close(actual, expected, rel=1e-9):
    """The invariant tests run in float64, so carried state must match recomputation far below fp32 rounding
    (in fp32, rounding differences can flip a near-tied MoE expert choice on random weights)."""
    err = (actual - expected).abs().max() / expected.abs().max()
    assert err <= rel, f"max |diff| / max |logit| = {err:.2e} > {rel:.0e}"


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 255, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompt_logits(engine, ids, rid="r", **kw):
    seq = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=1,
                                              ignore_eos=True), rid, keep_prompt_logits=True)
    return torch.cat(seq.prompt_logits)


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_plus_decode_equals_full_recompute(name):
    engine = make_engine(CONFIGS[name], dtype=F64)
    ids = prompt(37)
    seq = engine.generate(ids, GREEDY, keep_prompt_logits=True)
    step_logits = torch.cat(seq.step_logits)  # [C, vocab]: what each generated token was drawn from
    full = prompt_logits(make_engine(CONFIGS[name], dtype=F64), ids + seq.output[:-1])
    assert_logits_close(step_logits, full[len(ids) - 1:])


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("budget", [7, 64, 65])
def test_chunked_prefill_equals_one_shot(name, budget):
    ids = prompt(150, seed=1)
    one_shot = prompt_logits(make_engine(CONFIGS[name], dtype=F64), ids)
    chunked = prompt_logits(make_engine(CONFIGS[name], dtype=F64, prefill_token_budget=budget), ids)
    assert_logits_close(chunked, one_shot)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_do_not_depend_on_batch_neighbours(name):
    alone = make_engine(CONFIGS[name], dtype=F64)
    ref = alone.generate(prompt(29), GREEDY, "a", keep_prompt_logits=True)
    crowd = make_engine(CONFIGS[name], dtype=F64, prefill_token_budget=1000)
    seqs = [crowd.add_request(rid, prompt(n, seed=s), GREEDY, keep_prompt_logits=True)
            for rid, n, s in [("x", 70, 5), ("a", 29, 0), ("y", 3, 6), ("z", 130, 7)]]
    while crowd.has_work():
        crowd.step()
    a = seqs[1]
    assert a.output == ref.output
    torch.testing.assert_close(torch.cat(a.prompt_logits), torch.cat(ref.prompt_logits), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.cat(a.step_logits), torch.cat(ref.step_logits), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", CONFIGS)
def test_reused_slot_equals_fresh_slot(name):
    engine = make_engine(CONFIGS[name], dtype=F64, num_state_slots=1, num_kv_blocks=64)
    first = engine.generate(prompt(40), GREEDY, "first", keep_prompt_logits=True)
    engine.generate(prompt(55, seed=3), GREEDY, "other")
    again = engine.generate(prompt(40), GREEDY, "again", keep_prompt_logits=True)
    assert again.output == first.output
    torch.testing.assert_close(torch.cat(again.step_logits), torch.cat(first.step_logits), rtol=0, atol=0)


@pytest.mark.parametrize("name", CONFIGS)
def test_unused_slots_and_blocks_stay_untouched(name):
    engine = make_engine(CONFIGS[name], dtype=F64, num_state_slots=4, num_kv_blocks=32)
    pool, cache = engine.runner.kda_pool, engine.runner.kv_cache
    for t in (pool.recurrent, pool.conv, cache.kv):
        t.fill_(float("nan"))
    seq = engine.generate(prompt(33), GREEDY, "only", keep_prompt_logits=True)
    assert torch.isfinite(torch.cat(seq.step_logits)).all()
    touched = [s for s in range(4) if not torch.isnan(pool.recurrent[:, s]).all()]
    assert len(touched) == 1, f"slots {touched} were written; only the sequence's own slot may be"
    others = [s for s in range(4) if s not in touched]
    assert torch.isnan(pool.recurrent[:, others]).all() and torch.isnan(pool.conv[:, others]).all()
    used_blocks = cache.blocks.blocks_for(33 + 6)
    assert torch.isnan(cache.kv[:, used_blocks:]).all()


def test_max_tokens_one_finishes_at_prefill(linear_engine):
    linear_engine.add_request("one", prompt(10), SamplingParams(temperature=0.0, max_tokens=1))
    result = linear_engine.step()
    assert [p.kind for p in result.passes] == ["prefill"]
    (event,) = result.events
    assert event.finish_reason in ("length", "stop") and event.completion_tokens == 1 and event.prompt_tokens == 10
    assert not linear_engine.has_work() and linear_engine.scheduler.slots.num_free == 16


def test_cancel_returns_slot_and_blocks(linear_engine):
    linear_engine.add_request("c", prompt(20), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    linear_engine.step()
    assert linear_engine.scheduler.slots.num_free == 15
    event = linear_engine.cancel("c")
    assert event.finish_reason == "cancelled" and event.completion_tokens == 1
    assert linear_engine.scheduler.slots.num_free == 16
    assert linear_engine.scheduler.blocks.num_free == linear_engine.scheduler.blocks.num_blocks


def test_slot_exhaustion_queues_instead_of_failing():
    engine = make_engine(linear_config(), num_state_slots=2)
    seqs = [engine.add_request(f"q{i}", prompt(9, seed=i), GREEDY) for i in range(5)]
    engine.step()
    assert len(engine.scheduler.running) == 2 and engine.scheduler.num_waiting == 3
    while engine.has_work():
        engine.step()
    assert all(s.finish_reason == "length" and len(s.output) == 6 for s in seqs)


def test_kv_promise_admits_only_what_fits():
    engine = make_engine(linear_config(), num_state_slots=8, num_kv_blocks=10, kv_block_size=16)
    big = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)  # 20 + 60 tokens -> 5 blocks each
    seqs = [engine.add_request(f"k{i}", prompt(20, seed=i), big) for i in range(3)]
    engine.step()
    assert len(engine.scheduler.running) == 2
    while engine.has_work():
        engine.step()
    assert all(len(s.output) == 60 for s in seqs)
