"""OpenAI request bodies, field by field, through the official SDK (extra_body for fields it does not type): a field
that cannot change the reply is accepted and really changes nothing (the greedy reply equals the one without it); a
field that would change the reply and is not honoured is a 400 naming it; the aliases (max_tokens /
max_completion_tokens, stop as a string or a list, the developer role) mean what OpenAI says they mean."""

from __future__ import annotations

import openai
import pytest
from tokenizers import Tokenizer

from kimiserve.v1 import common_pb2, router_pb2

HELLO = [{"role": "user", "content": "Hello there"}]
BASE = dict(model="", messages=HELLO, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def baseline(http_stack):
    reply = http_stack.client.chat.completions.create(**BASE)
    assert reply.usage.completion_tokens == 6
    return reply.choices[0].message.content


def merged(**kw) -> dict:
    out = {**BASE, **kw}
    out["extra_body"] = {**BASE["extra_body"], **kw.get("extra_body", {})}
    return out


ACCEPTED_CHAT = {
    "user": dict(user="user-1"),
    "safety_identifier": dict(safety_identifier="hashed-user"),
    "metadata": dict(metadata={"run": "compat"}),
    "store true": dict(store=True),
    "store false": dict(store=False),
    "service_tier": dict(service_tier="auto"),
    "prompt_cache_key": dict(prompt_cache_key="conversation-7"),
    "prompt_cache_retention": dict(prompt_cache_retention="24h"),
    "prediction": dict(prediction={"type": "content", "content": "Hello"}),
    "parallel_tool_calls true": dict(parallel_tool_calls=True),
    "logit_bias empty": dict(logit_bias={}),
    "response_format text": dict(response_format={"type": "text"}),
    "modalities text": dict(modalities=["text"]),
    "verbosity medium": dict(verbosity="medium"),
    "functions empty": dict(functions=[]),
    "function_call auto": dict(function_call="auto"),
    "function_call none": dict(extra_body={"function_call": "none"}),
    "n 1": dict(n=1),
    "seed": dict(seed=7),  # greedy: the seed changes nothing
    "top_logprobs 0": dict(top_logprobs=0),
    "best_of 1": dict(extra_body={"best_of": 1}),
    "stream_options without stream": dict(stream_options={"include_usage": True}),
    "max_completion_tokens": dict(max_tokens=openai.omit, max_completion_tokens=6),
    "both max fields, equal": dict(extra_body={"max_completion_tokens": 6}),
    "nulls": dict(extra_body={"user": None, "metadata": None, "stop": None, "logit_bias": None, "audio": None}),
}


@pytest.mark.parametrize("kw", list(ACCEPTED_CHAT.values()), ids=list(ACCEPTED_CHAT))
def test_harmless_chat_fields_are_accepted_and_change_nothing(http_stack, baseline, kw):
    reply = http_stack.client.chat.completions.create(**merged(**kw))
    assert reply.choices[0].message.content == baseline
    assert reply.usage.completion_tokens == 6


def test_stream_options_include_usage_false_streams_without_usage(http_stack, baseline):
    chunks = list(http_stack.client.chat.completions.create(
        **merged(stream=True, stream_options={"include_usage": False, "include_obfuscation": True})))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == baseline
    assert all(c.usage is None for c in chunks)


REFUSED_CHAT = {
    "modalities": dict(modalities=["text", "audio"]),
    "audio": dict(audio={"voice": "alloy", "format": "wav"}),
    "reasoning_effort": dict(reasoning_effort="low"),
    "verbosity": dict(verbosity="low"),
    "web_search_options": dict(web_search_options={}),
    "moderation": dict(extra_body={"moderation": {"policy": "strict"}}),
    "functions": dict(functions=[{"name": "f", "parameters": {"type": "object"}}]),
    "function_call": dict(function_call={"name": "f"}),
    "max_tokens": dict(extra_body={"max_completion_tokens": 5}),  # differs from max_tokens=6
    "user": dict(extra_body={"user": 5}),  # ignored fields are still type-checked
    "store": dict(extra_body={"store": "yes"}),
    "best_of": dict(extra_body={"best_of": 2}),
    "typical_p": dict(extra_body={"typical_p": 0.9}),  # a vendor sampling field not implemented
    "frobnicate": dict(extra_body={"frobnicate": 1}),
    "stop": dict(extra_body={"stop": 5}),
    "seed": dict(seed=-(1 << 63) - 1),  # below int64
    "n": dict(n=0),
    "stream_options": dict(stream=True, stream_options={"include_usage": True, "chunk_size": 4}),
    "response_format": dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "description": "a reply", "schema": {"type": "object"}}}),
}


@pytest.mark.parametrize("field, kw", list(REFUSED_CHAT.items()), ids=list(REFUSED_CHAT))
def test_chat_fields_that_would_change_the_reply_are_400_naming_them(http_stack, field, kw):
    with pytest.raises(openai.BadRequestError) as refused:
        http_stack.client.chat.completions.create(**merged(**kw))
    error = refused.value.body
    assert error["param"] == field and field in error["message"], error
    assert error["code"] == "invalid_argument"


def test_a_negative_int64_seed_is_its_uint64_twos_complement(http_stack):
    def text(seed: int) -> str:
        return http_stack.client.completions.create(model="", prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                                    seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert text(-1) == text((1 << 64) - 1)
    assert text(-(1 << 63)) == text(1 << 63)


def test_developer_role_is_the_system_role(http_stack):
    """The developer turn reaches the prompt as the system turn: the same prompt length and greedy reply as "system",
    and a longer prompt than the default system turn it replaces (a dropped turn would give that one)."""
    instruction = "Answer briefly, in plain words, and name every novel by its full title and year. " * 4

    def reply(*first: dict) -> tuple[int, str]:
        out = http_stack.client.chat.completions.create(**merged(messages=[*first, *HELLO]))
        return out.usage.prompt_tokens, out.choices[0].message.content

    developer = reply({"role": "developer", "content": instruction})
    assert developer == reply({"role": "system", "content": instruction})
    assert developer[0] > reply()[0] + 40, "the developer turn did not reach the prompt"


def test_stop_as_a_string_or_a_list(http_stack):
    client = http_stack.client
    kw = dict(model="", prompt="Once upon a time", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    assert len(text) >= 4, repr(text)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    want = text[:text.find(stop)]
    for form in (stop, [stop], [stop, "\x00never"]):
        choice = client.completions.create(**kw, stop=form).choices[0]
        assert (choice.text, choice.finish_reason) == (want, "stop"), form


ACCEPTED_COMPLETIONS = {
    "user": dict(user="user-1"),
    "suffix empty": dict(suffix=""),
    "best_of 1": dict(best_of=1),
    "logit_bias empty": dict(logit_bias={}),
    "echo false": dict(echo=False),
    "seed": dict(seed=3),
    "metadata": dict(extra_body={"metadata": {"a": "b"}}),
}
REFUSED_COMPLETIONS = {
    "suffix": dict(suffix=" the end"),
    "best_of": dict(best_of=3),
    "reasoning_effort": dict(extra_body={"reasoning_effort": "high"}),
}


def test_logit_bias_forces_and_bans_tokens(http_stack):
    """+100 all but forces a token (every one of them is it), -100 all but bans it (the greedy reply's first token
    gives way to another)."""
    client, kw = http_stack.client, dict(model="", prompt="Once upon a time", max_tokens=6, temperature=0)
    forced = client.completions.create(**kw, logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    tok = Tokenizer.from_file(str(http_stack.model_dir / "tokenizer.json"))
    assert forced.choices[0].text == tok.decode([300] * 6)
    def grpc_ids(**sampling) -> list[int]:
        req = router_pb2.GenerateRequest(text=kw["prompt"], sampling=common_pb2.SamplingParams(
            max_tokens=6, temperature=0, **sampling))
        return [t for c in http_stack.grpc.Generate(req, metadata=http_stack.auth, timeout=60) for t in c.token_ids]
    plain = grpc_ids()
    banned = grpc_ids(logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]
    text = client.completions.create(**kw, logit_bias={str(plain[0]): -100}).choices[0].text
    assert text == tok.decode(banned) != client.completions.create(**kw).choices[0].text


def test_completions_fields(http_stack):
    client = http_stack.client
    kw = dict(model="", prompt="Once upon a time", max_tokens=5, temperature=0)
    want = client.completions.create(**kw).choices[0].text
    for name, extra in ACCEPTED_COMPLETIONS.items():
        assert client.completions.create(**kw, **extra).choices[0].text == want, name
    for field, extra in REFUSED_COMPLETIONS.items():
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**kw, **extra)
        assert refused.value.body["param"] == field and field in refused.value.body["message"], refused.value.body
