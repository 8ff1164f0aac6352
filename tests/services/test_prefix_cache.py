"""The prefix cache as a user meets it: the same long prompt twice through the router, the second prefill is
skipped (usage and the shard's counters say so) and the reply is identical; the next turn of a conversation hits."""

from __future__ import annotations

from tests.services.helpers import generate, scrape, total


def _shard_total(stack, name: str) -> float:
    return sum(total(scrape(stack.shard(i).metrics_url), name) for i in range(2))


def test_a_long_prompt_sent_twice_is_prefilled_once_with_identical_output(stack):
    prompt = [(i * 37) % 500 + 1 for i in range(300)]
    before = _shard_total(stack, "kimiserve_shard_prefill_tokens_total")
    first_ids, _, first = generate(stack.stub, prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    second_ids, _, second = generate(stack.stub, prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert second_ids == first_ids
    assert first.usage.cached_prompt_tokens == 0 and first.usage.prompt_tokens == 300
    assert second.usage.cached_prompt_tokens == 300 and second.usage.prompt_tokens == 300
    assert _shard_total(stack, "kimiserve_shard_prefill_tokens_total") - before == 300
    assert _shard_total(stack, "kimiserve_shard_prefix_cache_hit_tokens_total") >= 300


def test_the_next_turn_restores_the_finished_conversation(stack):
    turn1 = [(i * 11) % 400 + 2 for i in range(120)]
    out1, _, _ = generate(stack.stub, turn1, max_tokens=20, temperature=0.0, ignore_eos=True)
    turn2 = turn1 + out1 + [5, 6, 7, 8]
    _, _, last = generate(stack.stub, turn2, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert last.usage.cached_prompt_tokens == 120 + 20 - 1
