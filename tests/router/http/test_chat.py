"""POST /v1/chat/completions with the official openai SDK: plain and streamed replies are the same reply, equal to
the gRPC Chat stream (one flow), with OpenAI's shapes, usage, request ids and n choices."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from kimiserve.v1 import common_pb2, router_pb2
from tests.router.http.conftest import MAX_MODEL_LEN

HELLO = [{"role": "user", "content": "Hello"}]


def test_plain_reply_shape_usage_and_request_id(http_stack):
    raw = http_stack.client.chat.completions.with_raw_response.create(
        model="", messages=HELLO, max_tokens=6, temperature=0, extra_headers={"X-Request-Id": "http-chat-0001"})
    assert raw.headers["x-request-id"] == "http-chat-0001"
    reply = raw.parse()
    assert reply.id == "chatcmpl-http-chat-0001" and reply.object == "chat.completion"
    assert reply.model == http_stack.model and len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    u = reply.usage
    assert u.completion_tokens >= 1 and u.prompt_tokens > 1 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 0 <= u.prompt_tokens_details.cached_tokens <= u.prompt_tokens
    generated = http_stack.client.chat.completions.with_raw_response.create(model="", messages=HELLO, max_tokens=1)
    assert generated.headers["x-request-id"].startswith("req-")


def test_cached_tokens_come_from_the_prefix_cache(http_stack):
    messages = [{"role": "user", "content": "cache me " + " ".join(str(i) for i in range(60))}]
    first, second = (http_stack.client.chat.completions.create(model="", messages=messages, max_tokens=1)
                     for _ in range(2))
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert 0 < second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens_details.cached_tokens


def grpc_chat(http_stack, **sampling) -> tuple[str, common_pb2.Usage]:
    req = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="Hello")],
                                 sampling=common_pb2.SamplingParams(**sampling))
    chunks = list(http_stack.grpc.Chat(req, metadata=http_stack.auth, timeout=120))
    return "".join(c.text for c in chunks), chunks[-1].usage


def test_streamed_equals_plain_equals_grpc(http_stack):
    kw = dict(model=http_stack.model, messages=HELLO, max_tokens=10, temperature=0.9, seed=11)
    plain = http_stack.client.chat.completions.create(**kw)
    chunks = list(http_stack.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"  # the role comes first, alone
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    body = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert [c.choices[0].finish_reason for c in body][-1] == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert text == (plain.choices[0].message.content or "")
    grpc_text, grpc_usage = grpc_chat(http_stack, max_tokens=10, temperature=0.9, seed=11)
    assert grpc_text == text and grpc_usage.completion_tokens == plain.usage.completion_tokens


def test_n_choices_use_derived_seeds(http_stack):
    kw = dict(model="", messages=HELLO, max_tokens=8, temperature=1.0)
    both = http_stack.client.chat.completions.create(**kw, n=2, seed=40)
    assert [c.index for c in both.choices] == [0, 1]
    first = http_stack.client.chat.completions.create(**kw, seed=40)
    second = http_stack.client.chat.completions.create(**kw, seed=41)
    assert both.choices[0].message.content == first.choices[0].message.content
    assert both.choices[1].message.content == second.choices[0].message.content
    assert both.usage.prompt_tokens == first.usage.prompt_tokens  # the prompt is counted once
    assert both.usage.completion_tokens == first.usage.completion_tokens + second.usage.completion_tokens
    streamed = list(http_stack.client.chat.completions.create(**kw, n=2, seed=40, stream=True))
    for i, single in enumerate((first, second)):
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
        assert text == (single.choices[0].message.content or "")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C, sunny"},
]


def rendered_tokens(http_stack, messages, tools) -> int:
    """The prompt length the tokenizer service renders for the same conversation, built as gRPC messages."""
    pb = [common_pb2.ChatMessage(role=m["role"], content=m.get("content") or "", tool_call_id=m.get("tool_call_id", ""),
                                 tool_calls=[common_pb2.ToolCall(id=c["id"], name=c["function"]["name"],
                                                                 arguments=c["function"]["arguments"])
                                             for c in m.get("tool_calls", [])]) for m in messages]
    req = router_pb2.ChatRequest(messages=pb, tools=[common_pb2.Tool(json=json.dumps(t)) for t in tools],
                                 sampling=common_pb2.SamplingParams(max_tokens=1))
    return list(http_stack.grpc.Chat(req, metadata=http_stack.auth, timeout=60))[-1].usage.prompt_tokens


def test_tool_round_trip_is_rendered_as_sent(http_stack):
    reply = http_stack.client.chat.completions.create(model="", messages=ROUND_TRIP, tools=TOOLS, max_tokens=1)
    assert reply.usage.prompt_tokens == rendered_tokens(http_stack, ROUND_TRIP, TOOLS)
    without = rendered_tokens(http_stack, ROUND_TRIP, [])
    assert without < reply.usage.prompt_tokens  # the tools were declared
    none = http_stack.client.chat.completions.create(model="", messages=ROUND_TRIP, tools=TOOLS, tool_choice="none",
                                                     max_tokens=1)
    assert none.usage.prompt_tokens == without  # tool_choice none: the tools are not offered


def test_tool_choice_naming_an_unknown_function_is_refused(http_stack):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        http_stack.client.chat.completions.create(model="", messages=HELLO, tools=TOOLS, max_tokens=1,
                                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "'nope'" in e.value.body["message"] and "get_weather" in e.value.body["message"]


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
BOUNDED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
                 {"type": "function", "function": {"name": "ping", "parameters": PING}}]


def triples(calls) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of the SDK's tool calls."""
    return [(c.id, c.function.name, c.function.arguments) for c in calls]


def check_tool_calls(calls: list[tuple[str, str, str]], names: set[str]) -> None:
    assert calls
    for i, (call_id, name, arguments) in enumerate(calls):
        assert name in names and call_id == f"functions.{name}:{i}"
        jsonschema.validate(json.loads(arguments), {"get_weather": CITY, "ping": PING}[name])


def streamed_calls(chunks) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each call in a chat stream's tool-call deltas, put together by index as a client
    does (tests/router/http/test_tool_call_streaming.py checks the delta shapes)."""
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, [d.id, d.function.name, ""])
            call[2] += d.function.arguments
    return [tuple(calls[k]) for k in sorted(calls)]


def test_tool_choice_required_is_enforced_while_decoding(http_stack):
    # The tiny random model would never write a tool call by itself: every call here is the grammar's doing. Seeds
    # 3 and 4 draw replies that close their calls within the context left (seed 7's first choice writes calls until
    # a length limit cuts one: test_a_tool_call_reply_cut_by_max_tokens_finishes_with_length).
    reply = http_stack.client.chat.completions.create(model="", messages=HELLO, tools=BOUNDED_TOOLS, max_tokens=300,
                                                      tool_choice="required", n=2, temperature=1.0, seed=3)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_tool_calls(triples(choice.message.tool_calls), {"get_weather", "ping"})


def test_a_tool_call_reply_cut_by_max_tokens_finishes_with_length(http_stack):
    """Seed 3 (sampled by position) closes its calls within 300 tokens; seed 7 writes call after call, and 50 tokens
    cut one after whole ones (its third, once its name is written). Only a reply that ended by itself is a
    tool_calls finish; the cut call is still a call, with the id and arguments written so far (as OpenAI's API
    returns a call cut by the limit), and no marker of the tool-calls section reaches the content, streamed or not."""
    seen = set()
    for seed, max_tokens in ((3, 300), (7, 50)):
        reply = http_stack.client.chat.completions.create(model="", messages=HELLO, tools=BOUNDED_TOOLS,
                                                          max_tokens=max_tokens, tool_choice="required",
                                                          temperature=1.0, seed=seed)
        cut = reply.usage.completion_tokens == max_tokens or reply.usage.total_tokens == MAX_MODEL_LEN  # either limit
        assert reply.choices[0].finish_reason == ("length" if cut else "tool_calls"), (seed, reply.usage)
        calls = reply.choices[0].message.tool_calls
        assert calls, "a cut reply with no whole call would not test the rule"
        assert reply.choices[0].message.content is None
        check_tool_calls(triples(calls[:-1] if cut else calls), {"get_weather", "ping"})
        if cut:
            assert len(calls) >= 2 and calls[-1].id.startswith(f"functions.{calls[-1].function.name}:")
            with pytest.raises(json.JSONDecodeError):
                json.loads(calls[-1].function.arguments)
            stream = http_stack.client.chat.completions.create(
                model="", messages=HELLO, tools=BOUNDED_TOOLS, max_tokens=max_tokens, tool_choice="required",
                temperature=1.0, seed=seed, stream=True)
            chunks = [c for c in stream if c.choices]
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
            assert streamed_calls(chunks) == triples(calls)
        seen.add(cut)
    assert seen == {True, False}, "the seeds no longer give one cut and one closed reply: pick others"


def test_a_named_tool_choice_streams_exactly_one_call_to_it(http_stack):
    stream = http_stack.client.chat.completions.create(
        model="", messages=HELLO, tools=BOUNDED_TOOLS, max_tokens=300, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = [c for c in stream if c.choices]
    calls = streamed_calls(chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert len(calls) == 1
    check_tool_calls(calls, {"get_weather"})


def named_by_bytes(t) -> bool:
    """A logprob entry's token is its bytes' text, or `bytes:` + escapes for bytes that are not UTF-8 alone."""
    try:
        return t.token == bytes(t.bytes).decode("utf-8") if t.bytes else t.token.startswith("token_id:")
    except UnicodeDecodeError:
        return t.token == "bytes:" + "".join(f"\\x{x:02x}" for x in t.bytes)


def test_logprobs_are_delivered_per_token(http_stack):
    reply = http_stack.client.chat.completions.create(model="", messages=HELLO, max_tokens=5, temperature=0,
                                                      logprobs=True)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(t.logprob <= 0 and t.top_logprobs == [] and named_by_bytes(t) for t in content)
    streamed = list(http_stack.client.chat.completions.create(model="", messages=HELLO, max_tokens=5, temperature=0,
                                                              logprobs=True, stream=True))
    lps = [t.logprob for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert lps == [t.logprob for t in content]


def test_top_logprobs_alternatives(http_stack):
    reply = http_stack.client.chat.completions.create(model="", messages=HELLO, max_tokens=5, temperature=0,
                                                      logprobs=True, top_logprobs=3)
    for t in reply.choices[0].logprobs.content:
        alternatives = [a.logprob for a in t.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert alternatives[0] == pytest.approx(t.logprob)  # greedy: the chosen token is the most likely one
        assert all(named_by_bytes(a) for a in t.top_logprobs)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_json_schema_reply_parses_and_validates(http_stack):
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}
    for kw in (dict(temperature=0), dict(temperature=0.7, seed=5)):
        reply = http_stack.client.chat.completions.create(model="", messages=HELLO, max_tokens=48,
                                                          response_format=fmt, **kw)
        assert reply.choices[0].finish_reason == "stop", reply
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


CHOICES = ["a.b (c)", "x-y|z", "plain", "[0-9]+"]  # regex meta characters: each choice is its text, literally


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}])
def test_vllm_choice_gives_exactly_one_of_the_strings(http_stack, extra):
    texts = {http_stack.client.chat.completions.create(model="", messages=HELLO, max_tokens=24, temperature=1.0,
                                                       seed=seed, extra_body=extra).choices[0].message.content
             for seed in range(6)}
    assert texts <= set(CHOICES), texts


def test_vllm_regex_and_json_constrain_chat_and_completions(http_stack):
    pattern = "[0-9]{3}-[a-z]{2}"
    for extra in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        reply = http_stack.client.completions.create(model="", prompt="Code:", max_tokens=24, temperature=0.8,
                                                     seed=2, extra_body=extra).choices[0]
        assert re.fullmatch(pattern, reply.text) and reply.finish_reason == "stop", reply
    for schema in (SCHEMA, json.dumps(SCHEMA)):  # vLLM takes the schema as an object or as JSON text
        reply = http_stack.client.chat.completions.create(model="", messages=HELLO, max_tokens=48, temperature=0,
                                                          extra_body={"structured_outputs": {"json": schema}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("extra, param, needle", [
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "grammar is not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "set one of them"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs", "non-empty list of strings"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "both constrain the reply"),
    ({"structured_outputs": {"regex": "a"}, "tools": [{"type": "function", "function": {"name": "ping"}}],
      "tool_choice": "required"}, "tool_choice", "both constrain the reply"),
])
def test_vllm_structured_outputs_refusals_name_the_field(http_stack, extra, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        http_stack.client.chat.completions.create(model="", messages=HELLO, max_tokens=8, extra_body=extra)
    assert e.value.body["param"] == param and needle in e.value.body["message"]


def test_penalties_pass_through_and_change_the_output(http_stack):
    kw = dict(model="", prompt="The quick brown fox", max_tokens=48, temperature=0)
    penalties = dict(frequency_penalty=1.5, presence_penalty=0.5)
    extra = {"ignore_eos": True}
    penalised = http_stack.client.completions.create(**kw, **penalties, extra_body={**extra, "repetition_penalty": 1.3})
    plain = http_stack.client.completions.create(**kw, extra_body=extra)
    assert penalised.choices[0].text != plain.choices[0].text
    req = router_pb2.GenerateRequest(text="The quick brown fox", sampling=common_pb2.SamplingParams(
        max_tokens=48, temperature=0, ignore_eos=True, repetition_penalty=1.3, **penalties))
    grpc_text = "".join(c.text for c in http_stack.grpc.Generate(req, metadata=http_stack.auth, timeout=120))
    assert penalised.choices[0].text == grpc_text


def test_min_p_reaches_the_sampler(http_stack):
    """min_p 1 keeps only the most likely token, so a hot, seeded draw gives the greedy reply, each token with
    logprob 0 (the whole mass of the cut distribution); a small min_p leaves the draw free to differ."""
    kw = dict(model="", prompt="The quick brown fox", max_tokens=24, logprobs=1)
    greedy = http_stack.client.completions.create(**kw, temperature=0, extra_body={"ignore_eos": True})
    cut = http_stack.client.completions.create(**kw, temperature=1.5, seed=3,
                                               extra_body={"ignore_eos": True, "min_p": 1.0})
    assert cut.choices[0].text == greedy.choices[0].text
    assert cut.choices[0].logprobs.token_logprobs == [0.0] * 24
    loose = http_stack.client.completions.create(**kw, temperature=1.5, seed=3,
                                                 extra_body={"ignore_eos": True, "min_p": 0.001})
    assert loose.choices[0].text != greedy.choices[0].text
    assert min(loose.choices[0].logprobs.token_logprobs) < -0.5
