"""The sampling surface through the engine: penalties over a sequence's real history, top_logprobs in its events,
batch independence, and structured output with the tiny tokenizer's vocabulary on a tiny random model."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import jsonschema
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


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(out, 0)
    return out


@pytest.fixture(scope="module")
def grammars(tokenizer_dir) -> Grammars:
    return Grammars.for_checkpoint(tokenizer_dir, VOCAB, (EOS,))


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]], keep_logits: bool = False):
    """Adds every request, steps to the end; returns {request id: (sequence, its token events)}."""
    seqs = {rid: engine.add_request(rid, prompt, params, keep_logits) for rid, (prompt, params) in requests.items()}
    events = {rid: [] for rid in requests}
    while engine.has_work():
        for e in engine.step().events:
            events[e.request_id].append(e)
    return {rid: (seqs[rid], events[rid]) for rid in requests}


def penalised(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The three penalties by definition, looping over the token history."""
    ref = logits.double().clone()
    for t in set(prompt) | set(output):
        ref[t] = ref[t] / p.repetition_penalty if ref[t] > 0 else ref[t] * p.repetition_penalty
    for t in set(output):
        ref[t] -= p.presence_penalty + p.frequency_penalty * output.count(t)
    return ref


PROMPT = [5, 9, 9, 17, 33, 5, 70, 71]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5,
                   logprobs=True,
                   top_logprobs=5),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.9, logprobs=True,
                   top_logprobs=3),
])
def test_greedy_penalties_over_the_sequence_history(params):
    seq, events = run(make_engine(CONFIG), {"a": (PROMPT, params)}, keep_logits=True)["a"]
    steps = torch.cat(seq.step_logits)  # the raw logits each token was drawn from
    assert len(seq.output) == len(events) == params.max_tokens
    for i, (token, event) in enumerate(zip(seq.output, events, strict=True)):
        ref = penalised(steps[i], params, PROMPT, seq.output[:i])
        ref_lp = torch.log_softmax(ref, 0)
        assert token == int(torch.argmax(ref)), f"step {i}"
        assert event.logprob == pytest.approx(float(ref_lp[token]), abs=1e-5)
        want = torch.topk(ref_lp, params.top_logprobs)
        assert [t for t, _ in event.top_logprobs] == want.indices.tolist()
        assert [lp for _, lp in event.top_logprobs] == pytest.approx(want.values.tolist(), abs=1e-5)
    plain = run(make_engine(CONFIG), {"a": (PROMPT, SamplingParams(temperature=0.0, max_tokens=12,
                                                                   ignore_eos=True))})["a"][0]
    assert plain.output != seq.output, "the penalties changed the greedy output"


def test_penalised_sequences_do_not_depend_on_batch_neighbours():
    sampled = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=7, frequency_penalty=1.0,
                             repetition_penalty=1.4, logprobs=True, top_logprobs=4)
    alone = run(make_engine(CONFIG), {"a": (PROMPT, sampled)})["a"]
    crowd = run(make_engine(CONFIG), {
        "x": ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, presence_penalty=2.0)),
        "a": (PROMPT, sampled),
        "y": ([7] * 20, SamplingParams(max_tokens=14, ignore_eos=True, temperature=1.0, seed=1,
                                       repetition_penalty=0.5)),
        "z": ([40, 41], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))})["a"]
    assert crowd[0].output == alone[0].output
    # The model's fp32 logits move in the last bits with the batch (the sampler itself is exact per row:
    # test_sampling.py); the reported values agree to that precision.
    for c, a in zip(crowd[1], alone[1], strict=True):
        assert c.logprob == pytest.approx(a.logprob, abs=1e-5)
        assert [t for t, _ in c.top_logprobs] == [t for t, _ in a.top_logprobs]
        assert [lp for _, lp in c.top_logprobs] == pytest.approx([lp for _, lp in a.top_logprobs], abs=1e-5)


def test_a_reused_slot_starts_with_fresh_counts():
    """The second sequence takes the first one's state slot: its penalties must see only its own history."""
    p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, frequency_penalty=2.0)
    fresh = run(make_engine(CONFIG), {"b": (PROMPT, p)})["b"][0].output
    engine = make_engine(CONFIG, num_state_slots=1)
    run(engine, {"a": ([3, 4], p)})
    assert run(engine, {"b": (PROMPT, p)})["b"][0].output == fresh


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_keeps_the_stop_ids_out_until_then(temperature):
    """EOS biased to all but certain, and a stop id likewise: the sequence ends on the first token after min_tokens
    that may end it. Until then the stop ids have logprob -inf, every other token its renormalised share."""
    stop = 77
    bias = ((stop, 100.0), (EOS, 100.0))
    base = SamplingParams(temperature=temperature, seed=3, max_tokens=20, stop_token_ids=(stop,), logit_bias=bias,
                          logprobs=True, top_logprobs=3)
    free = run(make_engine(CONFIG), {"a": (PROMPT, base)})["a"][0]
    assert len(free.output) == 1 and free.output[0] in (stop, EOS), "the bias no longer ends it at once"
    seq, events = run(make_engine(CONFIG), {"a": (PROMPT, replace(base, min_tokens=5))}, keep_logits=True)["a"]
    assert len(seq.output) == 6 and seq.output[-1] in (stop, EOS) and seq.finish_reason == "stop"
    assert not {stop, EOS} & set(seq.output[:5])
    for e in events[:5]:
        assert {t for t, _ in e.top_logprobs}.isdisjoint({stop, EOS})
    back = sum(math.exp(lp) for t, lp in events[5].top_logprobs if t in (stop, EOS))
    assert back > 0.999, "after min_tokens the biased stop ids take the mass again"


def test_min_tokens_is_at_most_max_tokens_and_not_with_a_format(grammars):
    with pytest.raises(InvalidRequest, match=r"min_tokens must be <= max_tokens \(4\)"):
        make_engine(CONFIG).check_request("r", PROMPT, SamplingParams(max_tokens=4, min_tokens=5))
    with pytest.raises(InvalidRequest, match="min_tokens cannot be combined with response_format"):
        make_engine(CONFIG, grammars=grammars).check_request(
            "r", PROMPT, SamplingParams(temperature=0.0, min_tokens=2, response_format=ResponseFormat("json_object")))


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                               "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": -1,
                                                                            "maximum": 1}},
     "required": ["ok"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "enum-and-array", "bool-array", "optional-number"])
def test_json_schema_output_parses_and_validates(schema, grammars, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    engine = make_engine(CONFIG, grammars=grammars)
    fmt = ResponseFormat("json_schema", json.dumps(schema), "test")
    prompt = tok.encode("Reply in JSON:")
    for rid, params in [("greedy", SamplingParams(temperature=0.0, max_tokens=150, response_format=fmt)),
                        ("sampled", SamplingParams(max_tokens=150, temperature=1.0, seed=3, response_format=fmt,
                                                   presence_penalty=0.5, logprobs=True, top_logprobs=5))]:
        seq, events = run(engine, {rid: (prompt, params)})[rid]
        assert seq.finish_reason == "stop", (rid, seq.finish_reason, tok.decode(seq.output))
        text = tok.decode(seq.output)
        jsonschema.validate(json.loads(text), schema)
        for e in events if params.top_logprobs else ():
            # Alternatives come from the masked distribution: fewer than asked only where the format allows fewer
            # tokens, and then the drawn token is among them; a forced token has probability 1.
            tops = dict(e.top_logprobs)
            assert 1 <= len(tops) <= 5 and sum(torch.tensor(list(tops.values())).exp()) <= 1 + 1e-5
            if len(tops) < 5:
                assert e.token_id in tops
            if len(tops) == 1:
                assert tops[e.token_id] == pytest.approx(0.0, abs=1e-6)


def test_json_object_and_regex_formats(grammars, tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    engine = make_engine(CONFIG, grammars=grammars)
    obj = ResponseFormat("json_object")
    # A random model writes free-form keys until max_tokens as often as not, so the test takes runs that end and
    # checks that every run that ended holds an object (fixed model, prompts and seeds: the same runs each time).
    runs = run(engine, {"greedy": (tok.encode("Reply in JSON:"), SamplingParams(temperature=0.0, max_tokens=60,
                                                                                response_format=obj)),
                        **{f"s{seed}": (tok.encode("Hello there"), SamplingParams(
                            max_tokens=60, temperature=0.5, seed=seed, response_format=obj)) for seed in (1, 2)}})
    ended = [seq for seq, _ in runs.values() if seq.finish_reason == "stop"]
    assert runs["greedy"][0].finish_reason == "stop" and len(ended) >= 2
    assert all(isinstance(json.loads(tok.decode(seq.output)), dict) for seq in ended)
    for seq in ended:  # compact: exactly json.dumps's own ", " / ": " form, no other whitespace
        text = tok.decode(seq.output)
        assert json.dumps(json.loads(text), ensure_ascii=False) == text, text
    prompt = tok.encode("Hello")
    fmt = ResponseFormat("regex", r"(yes|no), [0-9]{2,4}")
    for rid, temperature in (("g", 0.0), ("s", 1.0)):
        seq = run(engine, {rid: (prompt, SamplingParams(max_tokens=40, temperature=temperature, seed=2,
                                                        response_format=fmt))})[rid][0]
        assert seq.finish_reason == "stop"
        text = tok.decode(seq.output)
        assert text.split(", ")[0] in ("yes", "no") and 2 <= len(text.split(", ")[1]) <= 4, text


def test_a_continuation_resumes_the_format_where_its_prior_output_left_it(grammars, tokenizer_dir):
    """A continuation of a constrained sequence (prompt + its first k tokens, prior_output = k, same seed) has its
    format advanced over those tokens and draws exactly the rest of the original; prior tokens the format refuses
    are refused at submit."""
    tok = load_tokenizer(tokenizer_dir)
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMAS[0]), "test")
    prompt = tok.encode("Reply in JSON:")
    params = SamplingParams(max_tokens=150, temperature=1.0, seed=3, response_format=fmt, presence_penalty=0.5)
    original = make_engine(CONFIG, grammars=grammars).generate(prompt, params)
    assert original.finish_reason == "stop"
    k = 6
    engine = make_engine(CONFIG, grammars=grammars)
    resumed = engine.add_request("resumed", prompt + original.output[:k], replace(params, max_tokens=150 - k),
                                 prior_output=k)
    while engine.has_work():
        engine.step()
    assert resumed.output == original.output[k:] and resumed.finish_reason == "stop"
    jsonschema.validate(json.loads(tok.decode(original.output[:k] + resumed.output)), SCHEMAS[0])
    prose = tok.encode("hi")
    with pytest.raises(InvalidRequest, match=rf"response_format refuses prior output token {prose[0]} \(index 0 of "):
        engine.check_request("not-json", prompt + prose, params, prior_output=len(prose))


@pytest.mark.parametrize("fmt,message", [
    (ResponseFormat("json_schema", json.dumps({"type": "objectx"})), "Invalid type"),
    (ResponseFormat("json_schema", json.dumps({"type": "array", "uniqueItems": True})), "uniqueItems"),
    (ResponseFormat("json_schema", json.dumps({"$ref": "http://example.com/s.json"})), "http://example.com"),
    (ResponseFormat("regex", "[a-"), "unclosed character class"),
])
def test_a_format_the_grammar_engine_cannot_enforce_is_refused_at_submit(fmt, message, grammars):
    engine = make_engine(CONFIG, grammars=grammars)
    with pytest.raises(InvalidRequest, match=message):
        engine.check_request("bad", [1, 2], SamplingParams(temperature=0.0, response_format=fmt))
    assert not engine.has_work()


def test_an_engine_without_a_tokenizer_refuses_formats():
    with pytest.raises(InvalidRequest, match="needs the checkpoint's tokenizer"):
        make_engine(CONFIG).check_request("r", [1], SamplingParams(temperature=0.0,
                                                                   response_format=ResponseFormat("json_object")))


def test_a_prompt_restored_from_the_prefix_cache_samples_as_a_fresh_one(grammars, tokenizer_dir):
    """A whole cached prompt's first token is drawn from the cached logits row (no pass): penalties, the format mask
    and top_logprobs apply to it exactly as after a prefill, and its penalty counts start from its own history."""
    tok = load_tokenizer(tokenizer_dir)
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMAS[2]))
    prompt = tok.encode("Reply in JSON:")
    params = SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.7, frequency_penalty=1.0,
                            logprobs=True,
                            top_logprobs=3, response_format=fmt)
    fresh_seq, fresh_events = run(make_engine(CONFIG, grammars=grammars), {"a": (prompt, params)})["a"]
    engine = make_engine(CONFIG, grammars=grammars, prefix_cache_entries=2)
    run(engine, {"warm": (prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                 presence_penalty=2.0))})
    seq, events = run(engine, {"a": (prompt, params)})["a"]
    assert seq.cached_tokens == len(prompt), "the second run restored the whole prompt"
    assert seq.output == fresh_seq.output and seq.finish_reason == fresh_seq.finish_reason == "stop"
    for e, f in zip(events, fresh_events, strict=True):
        assert e.logprob == pytest.approx(f.logprob, abs=1e-5)
        assert [t for t, _ in e.top_logprobs] == [t for t, _ in f.top_logprobs]


def test_kimi_tiktoken_vocabulary_gives_the_same_masks(tokenizer_dir, grammars, tmp_path):
    """A checkpoint with only Kimi's tiktoken.model (+ tokenizer_config.json) reaches the grammar engine through
    tokenizer_svc's loader: every step's mask equals the one built from tokenizer.json."""
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
    tiktoken_only = Grammars.for_checkpoint(tmp_path, VOCAB, (EOS,))
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMAS[0]))
    a, b = grammars.compile(fmt, "a"), tiktoken_only.compile(fmt, "b")
    for token in load_tokenizer(tokenizer_dir).encode('{"name": "river", "age": 42}'):
        assert torch.equal(grammars.masks([a]), tiktoken_only.masks([b]))
        assert a.consume_token(token) and b.consume_token(token)
    assert a.is_accepting() and b.is_accepting()


def test_a_greedy_json_schema_continuation_equals_the_uninterrupted_run_at_every_cut(grammars, tokenizer_dir):
    """Cut after the first token, mid-way and before the last: each continuation (prior_output = k) ends the format
    exactly as the whole run did, its token indices going on from k; a refused prior token names the field."""
    tok = load_tokenizer(tokenizer_dir)
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMAS[1]), "test")
    prompt = tok.encode("Reply in JSON:")
    params = SamplingParams(temperature=0.0, max_tokens=120, response_format=fmt)
    engine = make_engine(CONFIG, grammars=grammars, dtype=torch.float64)
    whole = engine.generate(prompt, params)
    assert whole.finish_reason == "stop"
    n = len(whole.output)
    for k in (1, n // 2, n - 1):
        seq = engine.add_request(f"k{k}", prompt + whole.output[:k], replace(params, max_tokens=120 - k),
                                 prior_output=k)
        events = []
        while engine.has_work():
            events += engine.step().events
        assert whole.output[:k] + seq.output == whole.output, f"continued {k} tokens in"
        assert [e.index for e in events if e.token_id is not None] == list(range(k, n))
    with pytest.raises(InvalidRequest) as e:
        engine.check_request("prose", prompt + tok.encode("hi"), params, prior_output=1)
    assert e.value.param == "response_format"
