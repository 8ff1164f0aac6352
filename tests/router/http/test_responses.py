"""POST /v1/responses with the official openai SDK (and curl for its SSE): a response is the chat reply to the same
conversation in items (message, function_call), streamed as OpenAI's typed events that add up to the whole response;
function calls round-trip; text.format constrains; fields it cannot honour are 400 naming them."""

from __future__ import annotations

import json
import subprocess

import jsonschema
import openai
import pytest

from tests.ci_tools import debian_tool
from tests.router.http.conftest import API_KEY

QUESTION, INSTRUCTIONS = "Who is Mr. Darcy?", "Answer briefly."
# An enum keeps the random model's arguments short, and a named tool_choice makes exactly one call to it.
WEATHER = {"type": "function", "name": "get_weather", "description": "today's weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]}},
                          "required": ["city"], "additionalProperties": False}}
CALL_WEATHER = {"type": "function", "name": "get_weather"}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


def chat_reply(http_stack, messages: list[dict], max_tokens: int, **kw):
    return http_stack.client.chat.completions.create(model="", messages=messages, max_tokens=max_tokens,
                                                     temperature=0, **kw)


def events_of(http_stack, request_id: str, **kw) -> list:
    with http_stack.client.responses.stream(model=http_stack.model, temperature=0,
                                            extra_headers={"X-Request-Id": request_id}, **kw) as stream:
        return list(stream)


def test_a_response_is_the_chat_reply_in_items(http_stack):
    raw = http_stack.client.responses.with_raw_response.create(
        model=http_stack.model, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0,
        metadata={"run": "1"}, store=True, extra_headers={"X-Request-Id": "responses-0001"})
    assert raw.headers["x-request-id"] == "responses-0001"
    r = raw.parse()
    chat = chat_reply(http_stack, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
                      8)
    assert r.id == "resp_responses-0001" and r.object == "response" and r.model == http_stack.model
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    finished = chat.choices[0].finish_reason
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == (
        ("incomplete", "max_output_tokens") if finished == "length" else ("completed", None))
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == r.status
    assert [p.type for p in message.content] == ["output_text"]
    # What the response repeats of the request; nothing is stored, and it says so.
    assert (r.instructions, r.max_output_tokens, r.temperature, r.metadata) == (INSTRUCTIONS, 8, 0, {"run": "1"})
    assert r.store is False and r.previous_response_id is None


def test_the_stream_adds_up_to_the_whole_response(http_stack):
    kw = dict(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=8)
    whole = http_stack.client.responses.create(model=http_stack.model, temperature=0,
                                               extra_headers={"X-Request-Id": "responses-whole"}, **kw)
    events = events_of(http_stack, "responses-streamed", **kw)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    last = events[-1]
    assert last.type == f"response.{whole.status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == last.response.output_text
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == [item.id for item in done] == [item.id for item in last.response.output]

    def without_ids(items) -> list[dict]:
        return [{k: v for k, v in item.model_dump().items() if k != "id"} for item in items]
    assert without_ids(last.response.output) == without_ids(whole.output) == without_ids(done)
    assert last.response.usage == whole.usage


def test_a_function_call_round_trips_as_the_chat_tool_turn(http_stack):
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    r = http_stack.client.responses.create(model=http_stack.model, input=asked, tools=[WEATHER],
                                           tool_choice=CALL_WEATHER, max_output_tokens=60, temperature=0)
    assert r.status == "completed"
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The client runs the tool and sends the conversation back: the items it was given, then the tool's output.
    following = asked + [item.model_dump(exclude_none=True) for item in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = http_stack.client.responses.create(model=http_stack.model, input=following, tools=[WEATHER],
                                                max_output_tokens=6, temperature=0)
    tool_turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
    chat = chat_reply(http_stack, asked + [tool_turn, {"role": "tool", "tool_call_id": call.call_id,
                                                       "content": "sunny"}], 6, tools=[CHAT_WEATHER])
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    streamed = events_of(http_stack, "responses-call", input=asked, tools=[WEATHER], tool_choice=CALL_WEATHER,
                         max_output_tokens=60)
    [args] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert (args.name, args.arguments) == (call.name, call.arguments)


def test_a_function_call_cut_by_max_output_tokens_is_an_incomplete_item(http_stack):
    """Greedy, so a shorter limit gives a prefix of the whole reply: cut three tokens before its end (the call's
    end, the section's end, the end of turn), the call is there with its arguments so far, marked incomplete."""
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model=http_stack.model, input=asked, tools=[WEATHER], tool_choice=CALL_WEATHER, temperature=0)
    whole = http_stack.client.responses.create(**kw, max_output_tokens=60)
    [call] = [item for item in whole.output if item.type == "function_call"]
    cut = http_stack.client.responses.create(**kw, max_output_tokens=whole.usage.output_tokens - 3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    [part] = [item for item in cut.output if item.type == "function_call"]
    assert part.status == "incomplete" and (part.call_id, part.name) == (call.call_id, call.name)
    assert call.arguments.startswith(part.arguments) and len(part.arguments) < len(call.arguments)
    assert not [item for item in cut.output if item.type == "message"]


def test_text_format_json_schema_constrains_the_reply(http_stack):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = http_stack.client.responses.create(model=http_stack.model, input="Is it fine?", max_output_tokens=30,
                                           text={"format": {"type": "json_schema", "name": "ok", "schema": schema,
                                                            "strict": True}}, temperature=0)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_logprobs_are_the_chat_replys_in_the_responses_shape(http_stack):
    chat = chat_reply(http_stack, [{"role": "user", "content": QUESTION}], 6, logprobs=True, top_logprobs=3)
    kw = dict(input=QUESTION, max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=3)
    whole = http_stack.client.responses.create(model=http_stack.model, temperature=0, **kw)
    [part] = whole.output[0].content
    assert whole.output_text == chat.choices[0].message.content

    def entries(logprobs) -> list[tuple]:
        return [(t.token, t.logprob, t.bytes, [(c.token, c.logprob, c.bytes) for c in t.top_logprobs])
                for t in logprobs]
    expected = entries(chat.choices[0].logprobs.content)
    assert len(expected) == chat.usage.completion_tokens and all(len(e[3]) == 3 for e in expected)
    assert entries(part.logprobs) == expected
    events = events_of(http_stack, "responses-logprobs", **kw)
    deltas = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert entries(deltas) == entries(done.logprobs) == expected


REFUSED = {
    "previous_response_id": dict(previous_response_id="resp_x"),
    "reasoning": dict(reasoning={"effort": "high"}),
    "background": dict(background=True),
    "max_output_tokens": dict(max_output_tokens=0),
    "tools[0]": dict(tools=[{"type": "web_search"}]),
    "tool_choice": dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),  # chat's shape
    "input[0].content[0]": dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    "input[1].type": dict(input=[{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_1"}]),
    "text.format": dict(text={"format": {"type": "json_schema", "name": "x"}}),
    "include": dict(include=["file_search_call.results"]),
    "top_logprobs": dict(top_logprobs=3),  # alternatives of logprobs not asked for (include)
}


def test_max_tool_calls_caps_built_in_tools_only_and_changes_nothing(http_stack):
    kw = dict(model=http_stack.model, input="Hi", max_output_tokens=4, temperature=0)
    assert (http_stack.client.responses.create(**kw, max_tool_calls=1).output_text
            == http_stack.client.responses.create(**kw).output_text)
    with pytest.raises(openai.BadRequestError, match="max_tool_calls must be an integer"):
        http_stack.client.responses.create(**kw, extra_body={"max_tool_calls": "one"})


@pytest.mark.parametrize("param, kw", list(REFUSED.items()), ids=list(REFUSED))
def test_what_cannot_be_honoured_is_400_naming_it(http_stack, param, kw):
    with pytest.raises(openai.BadRequestError) as refused:
        http_stack.client.responses.create(**({"model": http_stack.model, "input": "Hi"} | kw))
    assert refused.value.body["param"] == param, refused.value.body


def test_curl_sees_typed_events(http_stack):
    curl = debian_tool("curl", "curl")
    body = {"model": "", "input": "Hi", "max_output_tokens": 4, "stream": True}
    out = subprocess.run([curl, "-N", "-sS", "--fail-with-body", f"{http_stack.base}/v1/responses",
                          "-H", f"Authorization: Bearer {API_KEY}", "-H", "Content-Type: application/json",
                          "-d", json.dumps(body)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    events = [e.split("\n") for e in out.stdout.split("\n\n") if e]
    assert all(len(e) == 2 and e[0].startswith("event: ") and e[1].startswith("data: ") for e in events), events
    data = [json.loads(e[1][len("data: "):]) for e in events]
    assert [e[0][len("event: "):] for e in events] == [d["type"] for d in data]
    assert data[-1]["type"] in ("response.completed", "response.incomplete")
    assert data[-1]["response"]["usage"]["output_tokens"] <= 4
