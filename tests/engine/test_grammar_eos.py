"""Grammar set-up never stops a shard: a config.json eos id the tokenizer does not hold (a full-size config beside
the tiny tokenizer, as the served benchmark writes) leaves structured output refused per request, naming why, or
working with the eos ids the tokenizer has; everything else is served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimiserve.tokenizer_files.loading import load_tokenizer
from kimiserve.tokenizer_files.tiny import write_tiny_tokenizer
from shard_svc.engine.grammar import Grammars, ResponseFormat
from shard_svc.engine.sampling import SamplingParams
from shard_svc.errors import InvalidRequest
from tests.engine.conftest import linear_config, make_engine

VOCAB, IM_END, OUTSIDE = 1024, 514, 900  # the tiny tokenizer holds ids 0..767
JSON = ResponseFormat("json_object")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(out, 0)
    return out


def test_no_eos_in_the_tokenizer_refuses_formats_per_request_and_serves_the_rest(tokenizer_dir):
    grammars = Grammars.for_checkpoint(tokenizer_dir, VOCAB, (OUTSIDE,))
    engine = make_engine(linear_config(vocab_size=VOCAB, eos_token_id=OUTSIDE), grammars=grammars)
    with pytest.raises(InvalidRequest) as e:
        engine.check_request("r-1", [1, 2], SamplingParams(temperature=0.0, response_format=JSON))
    msg = str(e.value)
    assert "'r-1'" in msg and "eos_token_id [900]" in msg and "768 ids" in msg and "tokenizer.json" in msg
    seq = engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert seq.finish_reason == "length" and len(seq.output) == 4


def test_eos_ids_partly_in_the_tokenizer_end_formats_on_those(tokenizer_dir):
    grammars = Grammars.for_checkpoint(tokenizer_dir, VOCAB, (IM_END, OUTSIDE))
    assert grammars.refusal is None
    tok = load_tokenizer(tokenizer_dir)
    engine = make_engine(linear_config(vocab_size=VOCAB, eos_token_id=[IM_END, OUTSIDE]), grammars=grammars)
    seq = engine.generate(tok.encode("Reply in JSON:"), SamplingParams(temperature=0.0, max_tokens=60,
                                                                       response_format=JSON))
    assert seq.finish_reason == "stop" and isinstance(json.loads(tok.decode(seq.output)), dict)
    assert OUTSIDE not in seq.output


def test_a_tokenizer_larger_than_the_model_refuses_formats(tokenizer_dir):
    grammars = Grammars.for_checkpoint(tokenizer_dir, 600, (IM_END,))
    with pytest.raises(InvalidRequest, match="the tokenizer has more ids than the model"):
        grammars.compile(JSON, "r-2")
