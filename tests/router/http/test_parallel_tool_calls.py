"""parallel_tool_calls false holds while decoding: a scripted checkpoint (tests/scripted_model.py) that calls `ping`
over and over (after each call comes another) makes one call and stops, under tool_choice auto and required, over
chat, Responses and gRPC Chat; left free, it keeps calling until max_tokens."""

from __future__ import annotations

import openai
import pytest

from kimiserve.kimi_chat import ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN
from kimiserve.v1 import common_pb2, router_pb2
from tests.scripted_model import scripted_stack, tiny_ids, write_scripted_model

PING = {"type": "function", "function": {"name": "ping", "description": "check the line",
                                         "parameters": {"type": "object", "properties": {},
                                                        "additionalProperties": False}}}
USER = [{"role": "user", "content": "Ping twice."}]


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    ids = tiny_ids(tmp_path_factory.mktemp("ids"))  # its ids script the calls
    model = tmp_path_factory.mktemp("scripted") / "caller"
    call = [CALL_BEGIN, *ids("functions.ping:0"), ARG_BEGIN, *ids("{}"), CALL_END]
    write_scripted_model(model, ["<|im_middle|>", SECTION_BEGIN, *call, CALL_BEGIN])  # the last step loops back
    with scripted_stack(model) as stack:
        yield stack


def chat(caller, **kw):
    return caller["openai"].chat.completions.create(model="", messages=USER, tools=[PING], max_tokens=40,
                                                    temperature=0, **kw).choices[0]


def test_left_free_the_model_keeps_calling(caller):
    reply = chat(caller)
    assert reply.finish_reason == "length" and len(reply.message.tool_calls) >= 2


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_parallel_tool_calls_false_makes_one_call_and_stops(caller, tool_choice):
    reply = chat(caller, tool_choice=tool_choice, parallel_tool_calls=False)
    assert reply.finish_reason == "tool_calls"
    assert [(c.id, c.function.name, c.function.arguments) for c in reply.message.tool_calls] == [
        ("functions.ping:0", "ping", "{}")]


def test_ignore_eos_is_refused_naming_parallel_tool_calls(caller):
    with pytest.raises(openai.BadRequestError) as e:
        chat(caller, parallel_tool_calls=False, extra_body={"ignore_eos": True})
    assert e.value.body["param"] == "parallel_tool_calls" and "ignore_eos" in e.value.body["message"]


def test_responses_honour_and_echo_it(caller):
    r = caller["openai"].responses.create(model=caller["model"], input="Ping twice.", max_output_tokens=40,
                                          temperature=0, parallel_tool_calls=False,
                                          tools=[{"type": "function", **PING["function"]}])
    assert r.parallel_tool_calls is False and r.status == "completed"
    assert [(item.type, item.name) for item in r.output] == [("function_call", "ping")]


def test_grpc_chat_takes_it_too(caller):
    req = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="Ping twice.")],
                                 tools=[common_pb2.Tool(function=common_pb2.FunctionTool(
                                     name="ping", parameters_json='{"type": "object"}'))],
                                 sampling=common_pb2.SamplingParams(max_tokens=40, temperature=0),
                                 parallel_tool_calls=False)
    got = list(caller["grpc"].Chat(req, timeout=60))
    assert [c.name for c in got[-1].tool_calls] == ["ping"]
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_STOP
