"""The tool-call grammar (ResponseFormat tool_calls, built by shard_svc/engine/grammar.py from tool_choice): its Lark
text, its validation, and random walks over the tiny tokenizer's masks that must always end in a tool-calls section
the router's parser reads back, with arguments valid under each function's schema."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from kimiserve.kimi_chat import CALL_BEGIN, SECTION_BEGIN, SECTION_END, parse_tool_calls
from kimiserve.tokenizer_files.tiny import write_tiny_tokenizer
from shard_svc.engine.grammar import JSON_OPTIONS, Grammars, ResponseFormat, tool_calls_grammar
from shard_svc.errors import InvalidRequest

VOCAB, EOS = 1024, 514  # the tiny checkpoint's padded vocabulary and <|im_end|>
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
FUNCTIONS = (("get_weather", json.dumps(WEATHER)), ("ping", json.dumps(PING)))
SCHEMAS = {"get_weather": WEATHER, "ping": PING}


@pytest.fixture(scope="module")
def grammars(tmp_path_factory) -> Grammars:
    out: Path = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(out, 0)
    return Grammars.for_checkpoint(out, VOCAB, (EOS,))


def allowed(grammars: Grammars, matcher) -> list[int]:
    bits = grammars.masks([matcher])[0].tolist()
    return [t for t in range(VOCAB) if (bits[t // 32] >> (t % 32)) & 1]


def walk(grammars: Grammars, fmt: ResponseFormat, seed: int, limit: int = 400) -> str:
    """Random allowed tokens until the grammar stops (the engine then finishes the sequence: STOP); the text with
    special tokens kept."""
    matcher, rng, out = grammars.compile(fmt, f"walk-{seed}"), random.Random(seed), []
    while not matcher.is_stopped():
        assert len(out) < limit, f"seed {seed}: no end after {limit} tokens: {grammars.tokenizer.decode_str(out)!r}"
        token = rng.choice(allowed(grammars, matcher))
        assert matcher.consume_token(token)
        out.append(token)
    return grammars.tokenizer.decode_str(out)


def test_grammar_text_numbers_each_call_and_embeds_each_schema():
    lark = tool_calls_grammar(FUNCTIONS, 2)
    assert lark.splitlines()[0] == f"start: {SECTION_BEGIN} calls_0 {SECTION_END}"
    assert '"functions.get_weather:0"' in lark and '"functions.ping:1"' in lark and ":2" not in lark
    assert "calls_1?" in lark and "calls_2" not in lark  # at most two calls
    assert f"args_0: %json {json.dumps({'type': 'object', 'x-guidance': JSON_OPTIONS, **WEATHER})}" in lark


@pytest.mark.parametrize("seed", range(6))
def test_required_walks_end_in_one_or_more_valid_numbered_calls(grammars, seed):
    text = walk(grammars, ResponseFormat("tool_calls", functions=FUNCTIONS, max_calls=16), seed)
    content, calls = parse_tool_calls(text)
    assert content == "" and text.startswith(SECTION_BEGIN) and text.endswith(SECTION_END)
    assert 1 <= len(calls) <= 16
    for i, call in enumerate(calls):
        assert call.id == f"functions.{call.name}:{i}"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("seed", range(3))
def test_a_named_function_is_exactly_one_call_to_it(grammars, seed):
    fmt = ResponseFormat("tool_calls", functions=(FUNCTIONS[0],), max_calls=1)
    _, calls = parse_tool_calls(walk(grammars, fmt, seed))
    assert [c.id for c in calls] == ["functions.get_weather:0"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def test_markers_are_the_special_tokens_not_their_spelling(grammars):
    matcher = grammars.compile(ResponseFormat("tool_calls", functions=FUNCTIONS, max_calls=2), "markers")
    first = allowed(grammars, matcher)
    assert [grammars.tokenizer.decode_str([t]) for t in first] == [SECTION_BEGIN]
    matcher.consume_token(first[0])
    assert [grammars.tokenizer.decode_str([t]) for t in allowed(grammars, matcher)] == [CALL_BEGIN]


@pytest.mark.parametrize("functions, max_calls, needle", [
    ((), 1, "0 functions"),
    ((("f", ""),), 0, "max_calls must be in [1, 16]"),
    ((("f", ""),), 17, "max_calls must be in [1, 16]"),
    ((("f", ""), ("f", "")), 1, "non-empty and unique"),
    ((("", ""),), 1, "non-empty and unique"),
    ((("f", "{nope"),), 1, "function 'f' parameters: not JSON"),
    ((("f", "[1]"),), 1, "must be a JSON object schema, got list"),
])
def test_unusable_tool_calls_are_refused_by_name(grammars, functions, max_calls, needle):
    with pytest.raises(InvalidRequest, match=None) as e:
        grammars.compile(ResponseFormat("tool_calls", functions=functions, max_calls=max_calls), "bad")
    assert needle in str(e.value)


def test_a_schema_keyword_the_engine_cannot_enforce_is_refused(grammars):
    remote = json.dumps({"$ref": "https://example.com/schema.json"})
    with pytest.raises(InvalidRequest, match="cannot be enforced|tool_calls"):
        grammars.compile(ResponseFormat("tool_calls", functions=(("f", remote),), max_calls=1), "remote-ref")


@pytest.mark.parametrize("seed", range(4))
def test_json_is_compact_unless_the_schema_asks_for_free_whitespace(grammars, seed):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    text = walk(grammars, ResponseFormat("json_schema", json.dumps(schema)), seed, limit=40)
    assert text in {f'{{"ok": {b}, "n": {n}}}' for b in ("true", "false") for n in range(10)}, text
    free = {**schema, "x-guidance": {"whitespace_flexible": True}}
    matcher = grammars.compile(ResponseFormat("json_schema", json.dumps(free)), "free")
    assert matcher.consume_tokens(grammars.tokenizer.tokenize_str('{ \n "ok"'))  # the schema's own choice wins
    compact = grammars.compile(ResponseFormat("json_schema", json.dumps(schema)), "compact")
    assert not compact.consume_tokens(grammars.tokenizer.tokenize_str('{ \n "ok"'))


def special(grammars: Grammars, text: str) -> int:
    [token] = grammars.tokenizer.tokenize_str(text)
    return token


def text_first_matcher(grammars: Grammars, name: str):
    return grammars.compile(ResponseFormat("tool_calls", functions=(("ping", json.dumps(PING)),), max_calls=1,
                                           text_first=True), name)


@pytest.mark.parametrize("reply", [
    "Hello there",
    "<think>Let me see.</think>It is sunny.",
    f"Let me check.{SECTION_BEGIN}{CALL_BEGIN}functions.ping:0<|tool_call_argument_begin|>{{}}<|tool_call_end|>"
    f"{SECTION_END}",
    f"<think>A ping.</think>{SECTION_BEGIN}{CALL_BEGIN}functions.ping:0<|tool_call_argument_begin|>{{}}"
    f"<|tool_call_end|>{SECTION_END}",
])
def test_text_first_takes_text_thinking_and_at_most_one_call_then_ends(grammars, reply):
    matcher = text_first_matcher(grammars, "text-first")
    assert matcher.consume_tokens(grammars.tokenizer.tokenize_str(reply)), matcher.get_error()
    assert matcher.consume_token(EOS) and matcher.is_stopped()


def test_text_first_with_one_call_allows_no_second_call_and_no_text_after_the_section(grammars):
    matcher = text_first_matcher(grammars, "one-call")
    one = f"{SECTION_BEGIN}{CALL_BEGIN}functions.ping:0<|tool_call_argument_begin|>{{}}<|tool_call_end|>"
    assert matcher.consume_tokens(grammars.tokenizer.tokenize_str(one)), matcher.get_error()
    assert allowed(grammars, matcher) == [special(grammars, SECTION_END)]  # not CALL_BEGIN: a second call
    assert matcher.consume_token(special(grammars, SECTION_END))
    assert allowed(grammars, matcher) == [EOS]
