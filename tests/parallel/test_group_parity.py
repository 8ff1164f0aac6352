"""Group logits equal one-process logits, and usage is exact, on gloo groups of 2 and 4 processes.

Each group run executes every case of its world size in the same processes (one spawn per world size keeps the
suite fast). In-memory models and the checkpoint cases run in float64, so the only difference left is the order
of the all-reduce sums: logits must agree to 1e-9 relative (fp32 would leave ~1e-4 over 93 layers), tokens and
usage exactly, and every rank must hold bitwise the same logits (the router is replicated, so a rank that saw
different activations could route differently without any error).
"""

from __future__ import annotations

import pytest
import torch

from shard_svc.make_tiny import write_tiny_checkpoint
from tests.engine.conftest import k3_config, linear_config
from tests.parallel.harness import run_group
from tests.parallel.scenarios import Case, concurrent_requests, run_cases

REQUESTS = concurrent_requests()
CKPT_REQUESTS = concurrent_requests(vocab=1024)
SCENARIO = dict(requests=REQUESTS, cancels=(("cancelled", 3),), engine=dict(prefill_token_budget=64))
CKPT_SCENARIO = dict(requests=CKPT_REQUESTS, cancels=(("cancelled", 3),), engine=dict(prefill_token_budget=64))
DEEP_SCENARIO = dict(requests=CKPT_REQUESTS[:3], engine=dict(prefill_token_budget=64))  # many layers: fewer requests


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel")
    return {"linear": str(write_tiny_checkpoint("kimi_linear", root / "linear", seed=1)),
            "k3-93": str(write_tiny_checkpoint("kimi_k3", root / "k3-93", seed=2)),
            "k3-26": str(write_tiny_checkpoint("kimi_k3", root / "k3-26", seed=3, layers=26))}


def cases_2(ck) -> list[Case]:
    return [
        Case("linear tp2", 2, 1, raw=linear_config(), **SCENARIO),
        Case("linear ep2 (attention replicated)", 1, 2, raw=linear_config(), **SCENARIO),
        Case("k3-26 tp2 ep2", 2, 2, raw=k3_config(26), **SCENARIO),
        Case("checkpoint linear tp2 ep2", 2, 2, checkpoint=ck["linear"], **CKPT_SCENARIO),
        Case("checkpoint k3-93 tp2 ep2", 2, 2, checkpoint=ck["k3-93"], **DEEP_SCENARIO),
        Case("dummy k3-26 tp2 ep2", 2, 2, checkpoint=ck["k3-26"], dtype=torch.bfloat16, requests=CKPT_REQUESTS[:2],
             load_format="dummy"),
        # Last: a follower with another prefill budget plans differently, which must fail loudly on every rank.
        Case("divergence", 2, 1, raw=linear_config(), requests=REQUESTS[:1], engine=dict(prefill_token_budget=64),
             follower_engine=dict(prefill_token_budget=32)),
    ]


def cases_4(ck) -> list[Case]:
    return [
        Case("linear tp2 ep4 (two attention groups, 6 experts over 4)", 2, 4, raw=linear_config(), **SCENARIO),
        Case("checkpoint k3-26 tp4 ep4", 4, 4, checkpoint=ck["k3-26"], **DEEP_SCENARIO),
        Case("checkpoint linear tp4 ep2 (experts split in width)", 4, 2, checkpoint=ck["linear"], **CKPT_SCENARIO),
    ]


@pytest.fixture(scope="module")
def runs(checkpoints) -> dict[str, tuple[dict, list[dict]]]:
    """case name -> (rank 0's result, followers' results)."""
    out = {}
    for world, cases in ((2, cases_2(checkpoints)), (4, cases_4(checkpoints))):
        ranks = run_group(world, run_cases, cases)
        out.update({c.name: (ranks[0][c.name], [r[c.name] for r in ranks[1:]]) for c in cases})
    return out


NAMES = {"linear": "", "k3-93": "", "k3-26": ""}
PARITY = [c.name for c in cases_2(NAMES) + cases_4(NAMES) if c.name != "divergence" and c.load_format != "dummy"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", PARITY)
def test_group_equals_one_process(runs, name):
    leader, _ = runs[name]
    assert "error" not in leader, leader.get("error")
    group, ref = leader["group"], leader["reference"]
    assert ref and group.keys() == ref.keys()
    for rid in ref:
        g, r = group[rid], ref[rid]
        assert (g["tokens"], g["finish"], g["usage"]) == (r["tokens"], r["finish"], r["usage"]), rid
        assert g["usage"] == (len(r["prompt_logits"]), len(r["tokens"])), rid
        assert rel_err(g["prompt_logits"], r["prompt_logits"]) < 1e-9, rid
        if r["step_logits"] is not None:
            assert rel_err(g["step_logits"], r["step_logits"]) < 1e-9, rid
    expected = {"long-prefill": "length", "one-token": "length", "stops-early": "stop", "sampled": "length",
                "late": "length", "cancelled": "cancelled"}
    assert {rid: group[rid]["finish"] for rid in group} == {rid: expected[rid] for rid in group}


@pytest.mark.parametrize("name", PARITY)
def test_every_rank_holds_the_same_logits(runs, name):
    leader, followers = runs[name]
    assert followers and leader["group"], f"{name}: {len(followers)} followers, {len(leader['group'])} requests"
    for rank, follower in enumerate(followers, start=1):
        assert follower["group"].keys() == leader["group"].keys(), rank
        for rid, mine in follower["group"].items():
            for key in ("prompt_logits", "step_logits"):
                ref = leader["group"][rid][key]
                assert (mine[key] is None and ref is None) or torch.equal(mine[key], ref), (rank, rid, key)


@pytest.mark.parametrize("name", PARITY + ["dummy k3-26 tp2 ep2"])
def test_replicated_parameters_are_identical_on_every_rank(runs, name):
    leader, followers = runs[name]
    assert {f["replicated"] for f in followers} == {leader["replicated"]}


def test_dummy_weights_serve_a_group(runs):
    """--load-format dummy (benchmarks): each rank makes its slice on its device, seeded by parameter name."""
    leader, _ = runs["dummy k3-26 tp2 ep2"]
    assert {rid: r["usage"] for rid, r in leader["group"].items()} == {"long-prefill": (90, 7), "one-token": (12, 1)}


def test_divergent_plans_fail_every_rank_by_name(runs):
    leader, (follower,) = runs["divergence"]
    for result in (leader, follower):
        kind, message = result["error"]
        assert kind == "GroupDiverged" and "ranks computed different plans" in message
    assert "('long-prefill', 64)" in leader["error"][1] and "('long-prefill', 32)" in follower["error"][1]
