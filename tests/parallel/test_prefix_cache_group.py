"""The prefix cache in a shard group: a TP=2 group on gloo with the cache and its host tier on gives the tokens of
one process without a cache, with hits from the device and from the host tier; every rank makes the same cache
decisions (entries per tier, hits, evictions: the step's state digest compares them, and each rank reports them)."""

from __future__ import annotations

import pytest

from shard_svc.engine.sampling import SamplingParams
from tests.engine.conftest import linear_config
from tests.parallel.harness import run_group
from tests.parallel.scenarios import Case, Request, prompt, run_cases

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# finishing at prefill: the finish adds no second entry
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
A, B, C = prompt(37, 1), prompt(40, 2), prompt(26, 3)
# One device entry and two on the host. Each request is admitted after the one before it finished. B is longer than A,
# so when `a-longer`'s finish pushes a third entry to the host, the least valuable one dropped is `a` (restored
# already), not `b`.
REQUESTS = (
    Request("a", A, ONE),
    Request("b", B, ONE, at_step=3),  # `a` goes to the host
    Request("a-longer", A + prompt(9, 4), GREEDY, at_step=6),  # restores `a` from the host
    Request("b-again", B, GREEDY, at_step=14),  # the whole prompt from the host: its first token from the host row
    Request("c", C, ONE, at_step=20),
    Request("c-again", C, SamplingParams(max_tokens=5, temperature=0.8, seed=3, ignore_eos=True),
            at_step=23),  # the whole prompt on the device: its first token drawn on rank 0 from the cached row
)
CACHE = dict(prefill_token_budget=64, prefix_cache_entries=1, prefix_host_entries=2)
CASE = Case("linear tp2 prefix cache", 2, 1, raw=linear_config(), requests=REQUESTS, engine=CACHE,
            reference_engine=dict(prefill_token_budget=64))
# Last (it breaks the group): a follower whose host tier holds one entry drops `a` when rank 0 keeps it. No device
# pool differs, so only the cache's own counts in the step digest can catch it, at that step, before any hit differs.
DIVERGENT = Case("divergent host tier", 2, 1, raw=linear_config(), requests=REQUESTS[:3], engine=CACHE,
                 follower_engine={**CACHE, "prefix_host_entries": 1})


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_group(2, run_cases, [CASE, DIVERGENT])


@pytest.fixture(scope="module")
def ranks(runs) -> list[dict]:
    return [r[CASE.name] for r in runs]


def test_group_with_the_cache_equals_one_process_without(ranks):
    leader = ranks[0]
    assert "error" not in leader, leader.get("error")
    group, ref = leader["group"], leader["reference"]
    for rid in ref:
        assert (group[rid]["tokens"], group[rid]["finish"], group[rid]["usage"]) == \
            (ref[rid]["tokens"], ref[rid]["finish"], ref[rid]["usage"]), rid
        assert ref[rid]["cached"] == 0
    assert {rid: r["cached"] for rid, r in group.items()} == \
        {"a": 0, "b": 0, "a-longer": 37, "c": 0, "c-again": 26, "b-again": 40}


def test_every_rank_makes_the_same_cache_decisions(ranks):
    (leader_entries, leader_host, stats), (entries, host, follower_stats) = (r["prefix_cache"] for r in ranks)
    assert (entries, host, follower_stats) == (leader_entries, leader_host, stats)
    queried, hit, evictions, inserted, host_hit, host_evictions, *_snapshots_by_kind = stats
    assert hit == 37 + 26 + 40 and host_hit == 37 + 40 and evictions >= 3 and host_evictions >= 1


def test_ranks_whose_cache_decisions_differ_fail_by_name(runs):
    for rank in runs:
        kind, message = rank[DIVERGENT.name]["error"]
        assert kind == "GroupDiverged" and "hold different sequence state" in message, message
    assert "'a-longer', 46, 1" in runs[0][DIVERGENT.name]["error"][1]  # caught at the step that dropped `a`
