"""A continuation (`prior_output` trailing prompt ids that are output an earlier shard generated: how the router
fails a stream over) goes on exactly as the uninterrupted sequence would have, greedy: a response_format matcher is
advanced over them, the penalties count them as output (repetition too), and token indices and usage count them as
generated, not as prompt. Without `prior_output` the same resubmission diverges (the test can fail). The seeded half
is tests/engine/test_seeded_continuation.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kimiserve.tokenizer_files.loading import load_tokenizer
from kimiserve.tokenizer_files.tiny import write_tiny_tokenizer
from shard_svc.engine.grammar import Grammars, ResponseFormat
from shard_svc.engine.sampling import SamplingParams
from shard_svc.errors import InvalidRequest
from tests.engine.conftest import linear_config, make_engine

VOCAB, EOS = 1024, 514  # the tiny checkpoint's padded vocabulary and <|im_end|>
CONFIG = linear_config(vocab_size=VOCAB, eos_token_id=EOS)
F64 = torch.float64  # a continuation prefills what the original decoded; in float64 the two agree far below a draw
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]},
                                                    "maxItems": 4}},
          "required": ["name", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(out, 0)
    return out


@pytest.fixture(scope="module")
def grammars(tokenizer_dir) -> Grammars:
    return Grammars.for_checkpoint(tokenizer_dir, VOCAB, (EOS,))


def events_of(engine, rid: str, prompt: list[int], params: SamplingParams, prior_output: int = 0):
    seq = engine.add_request(rid, prompt, params, prior_output=prior_output)
    events = []
    while engine.has_work():
        events += [e for e in engine.step().events if e.request_id == rid]
    return seq, events


def continue_at(engine, prompt, params, original, k: int, prior_output: int | None = None):
    """Resubmits prompt + the first k outputs with the budget left, as the router does."""
    return events_of(engine, f"cont-{k}", prompt + original[:k], replace(params, max_tokens=params.max_tokens - k),
                     k if prior_output is None else prior_output)


def test_a_json_schema_continuation_equals_the_uninterrupted_run(grammars, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA), "person")
    params = SamplingParams(temperature=0.0, max_tokens=80, response_format=fmt)
    prompt = tok.encode("Reply in JSON:")
    engine = make_engine(CONFIG, grammars=grammars, dtype=F64)
    whole, _ = events_of(engine, "whole", prompt, params)
    assert whole.finish_reason == "stop" and isinstance(json.loads(tok.decode(whole.output)), dict)
    for k in (1, len(whole.output) // 2, len(whole.output) - 1):
        seq, events = continue_at(engine, prompt, params, whole.output, k)
        assert whole.output[:k] + seq.output == whole.output, f"continued {k} tokens in"
        assert [e.index for e in events if e.token_id is not None] == list(range(k, len(whole.output)))
        last = events[-1]
        assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == ("stop", len(prompt),
                                                                                    len(whole.output))


def test_a_refused_prior_output_names_the_field(grammars, tokenizer_dir):
    """The refusals themselves are in test_seeded_continuation.py; here: the field they blame, for the router."""
    tok = load_tokenizer(tokenizer_dir)
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA), "person")
    engine = make_engine(CONFIG, grammars=grammars)
    prompt, prose = tok.encode("Reply in JSON:"), tok.encode("hello")
    for ids, prior, params in ((prompt + prose, len(prose), SamplingParams(temperature=0.0, response_format=fmt)),
                               ([4, 5, 6], 3, SamplingParams(temperature=0.0, max_tokens=4))):
        with pytest.raises(InvalidRequest, match="prior") as e:
            engine.add_request("r-bad", ids, params, prior_output=prior)
        assert e.value.param == "prior_output_tokens"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8),
], ids=["presence-frequency", "repetition"])
def test_a_penalised_continuation_equals_the_uninterrupted_run(params):
    prompt = [5, 9, 9, 17, 33, 5, 70, 71]
    engine = make_engine(CONFIG, dtype=F64)
    whole, _ = events_of(engine, "whole", prompt, params)
    assert len(set(whole.output)) > 6, f"the penalties should spread the output: {whole.output}"
    for k in (3, 12):
        seq, _ = continue_at(engine, prompt, params, whole.output, k)
        assert whole.output[:k] + seq.output == whole.output, f"continued {k} tokens in"
    if params.repetition_penalty == 1.0:  # presence / frequency count output only: as prompt, the tail differs
        seq, _ = continue_at(engine, prompt, params, whole.output, 12, prior_output=0)
        assert whole.output[:12] + seq.output != whole.output, "the test cannot tell output from prompt"
