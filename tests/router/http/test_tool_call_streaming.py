"""Tool calls stream as they are written, over chat (raw chunks and the openai SDK's stream helper), Responses and
gRPC Chat: a scripted checkpoint (tests/scripted_model.py) answers `Ok`, calls `zap` with `{ "w": 9}` (eight argument
tokens) and closes with ` Bye`. Each streamed form adds up to the whole reply."""

from __future__ import annotations

import io
import json

import pytest

from kimiserve.kimi_chat import ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END
from kimiserve.v1 import common_pb2, router_pb2
from tests.router.http.test_batches import wait_terminal
from tests.scripted_model import scripted_stack, tiny_ids, write_scripted_model

ZAP = {"type": "function", "function": {"name": "zap", "description": "zap w times",
                                        "parameters": {"type": "object", "properties": {"w": {"type": "integer"}}}}}
USER = [{"role": "user", "content": "Zap it."}]
CALL_ID, ARGUMENTS = "functions.zap", '{ "w": 9}'
# What the script says before and after its tool-calls section.
HEAD, TAIL = "Ok", " Bye"


@pytest.fixture(scope="module")
def zapper(tmp_path_factory):
    ids = tiny_ids(tmp_path_factory.mktemp("ids"))  # its ids script the reply
    model = tmp_path_factory.mktemp("scripted") / "zapper"
    write_scripted_model(model, ["<|im_middle|>", *ids(HEAD), SECTION_BEGIN, CALL_BEGIN, *ids(CALL_ID), ARG_BEGIN,
                                 *ids(ARGUMENTS), CALL_END, SECTION_END, *ids(TAIL), "<|im_end|>"])
    with scripted_stack(model) as stack:
        yield stack


KW = dict(model="", messages=USER, tools=[ZAP], max_tokens=60, temperature=0)


def test_the_whole_reply_is_the_script(zapper):
    reply = zapper["openai"].chat.completions.create(**KW).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content == HEAD + TAIL
    assert [(c.id, c.type, c.function.name, c.function.arguments) for c in reply.message.tool_calls] == [
        (CALL_ID, "function", "zap", ARGUMENTS)]


def test_chat_streams_a_call_as_openai_does(zapper):
    """The call's first delta names it (id, type, name, no arguments yet), the next ones carry only arguments, in
    several chunks before the call's end; content before and after the section streams as content."""
    chunks = [c.choices[0] for c in zapper["openai"].chat.completions.create(**KW, stream=True) if c.choices]
    calls = [(i, call) for i, c in enumerate(chunks) for call in (c.delta.tool_calls or [])]
    first_i, first = calls[0]
    assert (first.index, first.id, first.type, first.function.name, first.function.arguments) == (
        0, CALL_ID, "function", "zap", "")
    rest = [call for _, call in calls[1:]]
    assert all(c.index == 0 and c.id is None and c.type is None and c.function.name is None for c in rest)
    assert "".join(c.function.arguments for c in rest) == ARGUMENTS
    assert len(rest) >= 4, "the arguments came in one piece: not streamed"
    content = [(i, c.delta.content) for i, c in enumerate(chunks) if c.delta.content]
    assert "".join(t for i, t in content if i < first_i) == HEAD
    assert "".join(t for i, t in content if i > first_i) == TAIL
    assert chunks[-1].finish_reason == "tool_calls"


def test_the_sdk_stream_helper_assembles_the_same_call(zapper):
    """openai's `chat.completions.stream` accumulates the deltas into the completion and names each event."""
    with zapper["openai"].chat.completions.stream(**KW) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion().choices[0]
    assert events.count("tool_calls.function.arguments.delta") >= 4
    assert "tool_calls.function.arguments.done" in events
    assert [(c.id, c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (CALL_ID, "zap", ARGUMENTS)]
    assert final.message.content == HEAD + TAIL and final.finish_reason == "tool_calls"


def test_responses_stream_the_arguments_and_keep_the_item_order(zapper):
    kw = dict(model=zapper["model"], input="Zap it.", max_output_tokens=60, temperature=0,
              tools=[{"type": "function", **ZAP["function"]}])
    whole = zapper["openai"].responses.create(**kw)
    events = list(zapper["openai"].responses.create(**kw, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) >= 4 and "".join(deltas) == ARGUMENTS
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert (done.name, done.arguments) == ("zap", ARGUMENTS)
    streamed = events[-1].response
    for r in (whole, streamed):
        assert [(item.type, item.status) for item in r.output] == [
            ("message", "completed"), ("function_call", "completed"), ("message", "completed")]
        assert [item.content[0].text for item in (r.output[0], r.output[2])] == [HEAD, TAIL]
        assert (r.output[1].call_id, r.output[1].name, r.output[1].arguments) == (CALL_ID, "zap", ARGUMENTS)
        assert len({item.id for item in r.output}) == 3, "item ids repeat"


def test_grpc_chat_streams_deltas_that_add_up_to_the_last_chunks_calls(zapper):
    req = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="Zap it.")],
                                 tools=[common_pb2.Tool(function=common_pb2.FunctionTool(
                                     name="zap", parameters_json='{"type": "object"}'))],
                                 sampling=common_pb2.SamplingParams(max_tokens=60, temperature=0))
    chunks = list(zapper["grpc"].Chat(req, timeout=60))
    deltas = [d for c in chunks for d in c.tool_call_deltas]
    assert (deltas[0].index, deltas[0].id, deltas[0].name) == (0, CALL_ID, "zap")
    assert all(not d.HasField("id") and not d.HasField("name") for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == ARGUMENTS and len(deltas) >= 5
    assert [(c.id, c.name, c.arguments) for c in chunks[-1].tool_calls] == [(CALL_ID, "zap", ARGUMENTS)]
    assert "".join(c.text for c in chunks) == HEAD + TAIL
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_a_batch_responses_line_keeps_its_function_call(zapper):
    """A batch result is stored whole (its text and its calls, not where the text stood): its response holds the
    reply's text as one message, then the same call."""
    client = zapper["openai"]
    body = {"model": zapper["model"], "input": "Zap it.", "max_output_tokens": 60, "temperature": 0,
            "tools": [{"type": "function", **ZAP["function"]}]}
    direct = client.responses.create(**body)
    line = {"custom_id": "zap", "method": "POST", "url": "/v1/responses", "body": body}
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
    done = wait_terminal(client, batch.id)
    [out] = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    items = out["response"]["body"]["output"]
    assert [(i["type"], i.get("call_id"), i.get("name"), i.get("arguments")) for i in items[1:]] == [
        ("function_call", CALL_ID, "zap", ARGUMENTS)]
    assert items[0]["content"][0]["text"] == direct.output_text == HEAD + TAIL
