"""Exact continuation of seeded sampled sequences on both model families: resubmitting prompt + the first k tokens
of an output with the same seed (how a stream fails over to another shard) draws exactly the rest of it, whatever
else that engine runs; different seeds draw different tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shard_svc.engine.sampling import SamplingParams
from shard_svc.errors import InvalidRequest
from tests.engine.conftest import k3_config, linear_config, make_engine

# float64 models: a continuation prefills what the original decoded, and in float64 the two paths' logits agree far
# below anything that could move a draw (tests/engine/test_invariants.py holds them to 1e-9).
F64 = torch.float64
FAMILIES = {"kimi_linear": linear_config(), "k3": k3_config(8)}
PROMPT = [11, 4, 200, 37, 37, 90, 3, 150, 61]
SAMPLED = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=1234)
CUTS = (1, 7, 16)


def run_together(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Adds every request at once and steps them to the end, batched together; returns each one's output."""
    seqs = {rid: engine.add_request(rid, prompt, params) for rid, (prompt, params) in requests.items()}
    while engine.has_work():
        engine.step()
    return {rid: seq.output for rid, seq in seqs.items()}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> dict:
    return FAMILIES[request.param]


def test_a_continuation_draws_the_tail_of_the_original(family):
    seeds = (SAMPLED.seed, SAMPLED.seed + 1)  # the router's seeds for choices 0 and 1 of one request
    originals = run_together(make_engine(family, dtype=F64),
                             {f"s{s}": (PROMPT, replace(SAMPLED, seed=s)) for s in seeds})
    for out in originals.values():
        assert len(out) == SAMPLED.max_tokens and len(set(out)) > 8, f"not a sampled-looking output: {out}"
    assert originals[f"s{seeds[0]}"] != originals[f"s{seeds[1]}"], "two seeds (two choices) drew the same tokens"
    # Another engine (another shard) takes every continuation at once, batched beside a greedy and an unseeded
    # neighbour, with prompts of different lengths, so each one's positions sit at different rows of every pass.
    continuations = {f"s{s}-k{k}": (PROMPT + originals[f"s{s}"][:k],
                                    replace(SAMPLED, seed=s, max_tokens=SAMPLED.max_tokens - k))
                     for s in seeds for k in CUTS}
    neighbours = {"greedy": ([7] * 30, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
                  "unseeded": ([5, 6], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))}
    tails = run_together(make_engine(family, dtype=F64), neighbours | continuations)
    for s in seeds:
        for k in CUTS:
            assert tails[f"s{s}-k{k}"] == originals[f"s{s}"][k:], f"seed {s}, continued {k} tokens in"


def test_an_unseeded_sequence_keeps_the_seed_it_was_given(family):
    """The shard draws an unseeded sequence's seed once, at submission: two such sequences differ, and either one
    continues exactly when that seed is sent back with its continuation."""
    engine = make_engine(family, dtype=F64)
    unseeded = replace(SAMPLED, seed=None)
    a, b = (engine.add_request(rid, PROMPT, unseeded) for rid in ("a", "b"))
    while engine.has_work():
        engine.step()
    assert a.output != b.output
    k = 5
    again = make_engine(family, dtype=F64).generate(PROMPT + a.output[:k],
                                                    replace(SAMPLED, seed=a.draws.seed, max_tokens=24 - k))
    assert again.output == a.output[k:]


def test_a_seed_outside_uint64_is_refused_naming_it():
    engine = make_engine(linear_config())
    for seed in (-1, 1 << 64):
        with pytest.raises(InvalidRequest, match=rf"seed must be in \[0, 2\^64\).*got {seed}") as e:
            engine.add_request(f"bad{seed}", PROMPT, replace(SAMPLED, seed=seed))
        assert e.value.param == "seed"


PENALISED = replace(SAMPLED, presence_penalty=1.5, frequency_penalty=1.0, repetition_penalty=1.3, logprobs=True)


def drawn(engine, requests: dict[str, tuple[list[int], SamplingParams, int]]) -> dict[str, list[tuple[int, float]]]:
    """Runs (prompt, params, prior output) requests together; returns each one's (token, logprob) draws."""
    for rid, (prompt, params, prior) in requests.items():
        engine.add_request(rid, prompt, params, prior_output=prior)
    out = {rid: [] for rid in requests}
    while engine.has_work():
        for e in engine.step().events:
            out[e.request_id].append((e.token_id, e.logprob))
    return out


def test_a_continuation_counts_its_prior_output_in_the_penalties(family):
    """Presence and frequency penalties count the output only: a continuation says how many of its prompt's last
    tokens are its earlier output, and then samples the original's tail from the same penalised distributions."""
    original = drawn(make_engine(family, dtype=F64), {"o": (PROMPT, PENALISED, 0)})["o"]
    k = 7
    prompt, resumed = PROMPT + [t for t, _ in original[:k]], replace(PENALISED, max_tokens=PENALISED.max_tokens - k)
    got = drawn(make_engine(family, dtype=F64), {"told": (prompt, resumed, k), "untold": (prompt, resumed, 0)})
    assert [t for t, _ in got["told"]] == [t for t, _ in original[k:]]
    assert [lp for _, lp in got["told"]] == pytest.approx([lp for _, lp in original[k:]], abs=1e-5)
    # Without the count the prior tokens are only the prompt's: their presence and frequency penalties are gone,
    # and the distributions (so the reported logprobs) differ.
    assert [lp for _, lp in got["untold"]] != pytest.approx([lp for _, lp in original[k:]], abs=1e-5)


def test_prior_output_must_leave_the_original_prompt():
    engine = make_engine(linear_config())
    with pytest.raises(InvalidRequest, match=r"prior_output_tokens 9 must be below the prompt's 9 tokens"):
        engine.add_request("all-prior", PROMPT, SAMPLED, prior_output=9)
