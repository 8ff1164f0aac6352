"""The prefill budget sharing policy (shard_svc/engine/prefill_share.py), with sizes worked out by hand, and its
invariants over random mixes of prompts."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest

from bench.configs import KIMI_LINEAR_48B
from shard_svc.config import ModelConfig
from shard_svc.engine.prefill_share import PrefillShare, context_tokens_per_token
from shard_svc.errors import SchedulingConfigError


@dataclass(eq=False)
class Seq:
    length: int
    num_computed: int = 0
    prompt: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.prompt = [1] * self.length


def sizes(plan) -> list[tuple[int, int]]:
    return [(s.length, n) for s, n in plan]


def test_fcfs_gives_the_first_prompt_the_whole_budget():
    long, short = Seq(1000), Seq(10)
    assert sizes(PrefillShare(100, "fcfs").plan([long, short], others_running=True)) == [(1000, 100)]


def test_a_short_prompt_goes_whole_into_the_next_pass_beside_a_long_one():
    long, short = Seq(1000, num_computed=300), Seq(10)
    # threshold 50 (half the budget): 10 left is short, 700 is long; the long one takes the other 90
    assert sizes(PrefillShare(100).plan([long, short], others_running=False)) == [(1000, 90), (10, 10)]


def test_the_long_prompt_keeps_its_floor_whatever_waits():
    long, shorts = Seq(1000), [Seq(30) for _ in range(5)]
    # floor 25 (a quarter of 100) held back: the shorts share 75 (30, 30, 15 of the third), the long one gets 25
    plan = PrefillShare(100).plan([long, *shorts], others_running=False)
    assert sizes(plan) == [(1000, 25), (30, 30), (30, 30), (30, 15)]


def test_a_long_prompt_alone_takes_whole_budgets_at_any_context():
    long = Seq(20_000, num_computed=9000)
    share = PrefillShare(1000, context_tokens=1000.0)
    assert sizes(share.plan([long], others_running=False)) == [(20_000, 1000)]


def test_while_others_decode_a_long_chunk_is_cut_to_the_cost_cap_in_kda_chunks():
    long = Seq(20_000, num_computed=9000)
    share = PrefillShare(1000, long_floor=100, mixed_cost=2000, context_tokens=1000.0)
    # a token at 9000 + x costs 1 + (9000 + x) / 1000, about 10.1: 192 tokens cost 192 * 10.096 = 1938 <= 2000,
    # 256 would cost 256 * 10.128 = 2593; 198 fit, cut down to a multiple of 64
    assert sizes(share.plan([long], others_running=True)) == [(20_000, 192)]


def test_the_floor_wins_over_the_cost_cap():
    long = Seq(20_000, num_computed=9000)
    share = PrefillShare(1000, long_floor=250, mixed_cost=2000, context_tokens=1000.0)
    assert sizes(share.plan([long], others_running=True)) == [(20_000, 250)]


def test_a_second_long_prompt_gets_only_what_the_first_leaves():
    first, second = Seq(5000), Seq(5000)
    assert sizes(PrefillShare(100).plan([first, second], others_running=False)) == [(5000, 100)]
    first.num_computed = 4960  # 40 left: short now; the other long one takes the remaining 60
    assert sizes(PrefillShare(100).plan([first, second], others_running=False)) == [(5000, 40), (5000, 60)]


def test_prompts_below_the_threshold_run_first_come_first_served():
    a, b, c = Seq(40), Seq(40), Seq(40)
    assert sizes(PrefillShare(100).plan([a, b, c], others_running=True)) == [(40, 40), (40, 40), (40, 20)]


def test_tokens_within_inverts_the_cost():
    rng = random.Random(0)
    share = PrefillShare(8192, context_tokens=40_000.0)
    for _ in range(500):
        start, cost = rng.randrange(0, 1 << 20), rng.uniform(0, 50_000)
        n = share.tokens_within(start, cost)
        assert share.cost(start, n) <= cost + 1e-6 < share.cost(start, n + 1)


@pytest.mark.parametrize("seed", range(5))
def test_random_mixes_keep_the_budget_and_never_starve_the_long_prompt(seed):
    rng = random.Random(seed)
    share = PrefillShare(512, context_tokens=2000.0)
    long = Seq(100_000)
    passes = 0
    while long.num_computed < long.length:
        shorts = [Seq(rng.randrange(1, 257)) for _ in range(rng.randrange(0, 8))]
        plan = share.plan([long, *shorts], others_running=rng.random() < 0.5)
        got = dict((id(s), n) for s, n in plan)
        assert sum(got.values()) <= 512
        assert got[id(long)] >= min(share.floor, long.length - long.num_computed)
        served = [s for s in shorts if id(s) in got]  # in arrival order, none skipped, only the last one cut
        assert served == shorts[:len(served)]
        assert all(got[id(s)] == s.length for s in served[:-1])
        long.num_computed += got[id(long)]
        passes += 1
    assert passes <= math.ceil(100_000 / share.floor)


def test_settings_that_cannot_work_are_refused_by_name():
    with pytest.raises(SchedulingConfigError, match="floor 600 exceeds the prefill token budget 512"):
        PrefillShare(512, long_floor=600)
    with pytest.raises(SchedulingConfigError, match="'lifo' is not one of fair, fcfs"):
        PrefillShare(512, "lifo")
    with pytest.raises(SchedulingConfigError, match="mixed cost must be >= 1"):
        PrefillShare(512, mixed_cost=0)


def test_context_weight_of_the_48b_shape_matches_its_published_active_size():
    # Kimi-Linear-48B-A3B: about 3e9 active parameters, one multiply-add each per token; its 7 MLA layers of 32
    # heads do (192 + 128) multiply-adds per head per context position. An independent estimate: 3e9 / 71,680.
    estimate = 3e9 / (7 * 32 * (192 + 128))
    assert context_tokens_per_token(ModelConfig.from_dict(dict(KIMI_LINEAR_48B))) == pytest.approx(estimate, rel=0.2)
