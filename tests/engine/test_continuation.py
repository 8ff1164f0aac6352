"""A continuation (`prior_output` trailing prompt ids that are output an earlier shard generated: how the router
fails a stream over) goes on exactly as the uninterrupted sequence would have, greedy, with the penalties counting
the prior output as output (repetition too), and its events count the prior output as generated: token indices go on
from it, usage's prompt excludes it and its completion includes it. Without `prior_output` the same resubmission
diverges (the test can fail). Formats: tests/engine/test_sampling_engine.py; seeds: test_seeded_continuation.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shard_svc.engine.sampling import SamplingParams
from shard_svc.errors import InvalidRequest
from tests.engine.conftest import linear_config, make_engine

CONFIG = linear_config()
F64 = torch.float64  # a continuation prefills what the original decoded; in float64 the two agree far below a draw
PROMPT = [5, 9, 9, 17, 33, 5, 70, 71]


def events_of(engine, rid: str, prompt: list[int], params: SamplingParams, prior_output: int = 0):
    seq = engine.add_request(rid, prompt, params, prior_output=prior_output)
    events = []
    while engine.has_work():
        events += [e for e in engine.step().events if e.request_id == rid]
    return seq, events


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8),
], ids=["presence-frequency", "repetition"])
def test_a_penalised_continuation_equals_the_uninterrupted_run_and_counts_its_prior_output(params):
    engine = make_engine(CONFIG, dtype=F64)
    whole, _ = events_of(engine, "whole", PROMPT, params)
    assert len(set(whole.output)) > 6, f"the penalties should spread the output: {whole.output}"
    for k in (3, 12):
        seq, events = events_of(engine, f"k{k}", PROMPT + whole.output[:k], replace(params, max_tokens=24 - k), k)
        assert whole.output[:k] + seq.output == whole.output, f"continued {k} tokens in"
        assert [e.index for e in events if e.token_id is not None] == list(range(k, 24))
        last = events[-1]
        assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("length", len(PROMPT), 24)
    if params.repetition_penalty == 1.0:  # presence / frequency count output only: as prompt, the tail differs
        seq, _ = events_of(engine, "untold", PROMPT + whole.output[:12], replace(params, max_tokens=12))
        assert whole.output[:12] + seq.output != whole.output, "the test cannot tell output from prompt"


def test_a_prior_output_refusal_names_the_field():
    with pytest.raises(InvalidRequest, match="prior_output_tokens 3 must be below") as e:
        make_engine(CONFIG).add_request("r-all", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=4),
                                        prior_output=3)
    assert e.value.param == "prior_output_tokens"
