"""gRPC `n` and enforced tool_choice through the real stack (router, tokenizer, shards over gRPC): choices
demultiplexed by choice_index with exact usage, derived ids that no client id can collide with, n refused above its
bound and in batch requests, and tool calls the tiny random model can only write validly because decoding enforces
the grammar."""

from __future__ import annotations

import json
from collections import defaultdict

import grpc
import jsonschema
import pytest

from kimiserve.limits import MAX_N
from kimiserve.v1 import common_pb2, router_pb2
from tests.services.helpers import wait_until

ToolChoice = router_pb2.ToolChoice
PROMPT = "The quick brown fox"
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
PING = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMAS = {"get_weather": CITY, "ping": PING}
TOOLS = [common_pb2.Tool(json=json.dumps({"type": "function", "function": {"name": "get_weather",
                                                                           "parameters": CITY}})),
         common_pb2.Tool(function=common_pb2.FunctionTool(name="ping", parameters_json=json.dumps(PING)))]
USER = [common_pb2.ChatMessage(role="user", content="Weather in Paris?")]


def by_choice(chunks) -> dict[int, list]:
    out = defaultdict(list)
    for c in chunks:
        out[c.choice_index].append(c)
    return out


def test_n_choices_stream_apart_with_their_own_usage_and_the_total_last(stack):
    req = router_pb2.GenerateRequest(text=PROMPT, n=3, sampling=common_pb2.SamplingParams(
        max_tokens=6, temperature=1.0, seed=11, ignore_eos=True))
    chunks = list(stack.stub.Generate(req, timeout=120))
    choices = by_choice(chunks)
    assert sorted(choices) == [0, 1, 2]
    for got in choices.values():  # each choice: one last chunk, at its end, with its own exact usage
        assert [c.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED for c in got] == [False] * (len(got) - 1) + [
            True]
        assert got[-1].usage.completion_tokens == sum(len(c.token_ids) for c in got) == 6
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert [c.HasField("total_usage") for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert (chunks[-1].total_usage.prompt_tokens, chunks[-1].total_usage.completion_tokens) == (prompt_tokens, 18)
    ids = {i: [t for c in got for t in c.token_ids] for i, got in choices.items()}
    assert len({tuple(v) for v in ids.values()}) > 1, "seeded choices 0..2 drew the same tokens"
    # Choice i is the single request with seed + i: reproducible, and the same as HTTP's rule.
    for i in (0, 2):
        alone = router_pb2.GenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(
            max_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True))
        single = list(stack.stub.Generate(alone, timeout=120))
        assert [t for c in single for t in c.token_ids] == ids[i]
        assert single[-1].total_usage == single[-1].usage  # n = 1: the total is the one choice's usage


def test_greedy_chat_choices_are_identical_and_usage_counts_the_prompt_once(stack):
    req = router_pb2.ChatRequest(messages=USER, n=3, sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0))
    choices = by_choice(stack.stub.Chat(req, timeout=120))
    replies = {i: ("".join(c.text for c in got), [t for c in got for t in c.token_ids]) for i, got in choices.items()}
    assert sorted(replies) == [0, 1, 2] and replies[0] == replies[1] == replies[2]
    lasts = [got[-1] for got in choices.values()]
    total = [c.total_usage for got in choices.values() for c in got if c.HasField("total_usage")]
    assert len(total) == 1
    assert total[0].prompt_tokens == lasts[0].usage.prompt_tokens
    assert total[0].completion_tokens == sum(c.usage.completion_tokens for c in lasts)


@pytest.mark.parametrize("rpc, req", [
    ("Generate", router_pb2.GenerateRequest(text=PROMPT, n=MAX_N + 1)),
    ("Chat", router_pb2.ChatRequest(messages=USER, n=1000)),
])
def test_n_over_the_bound_is_invalid_argument_naming_it(stack, rpc, req):
    with pytest.raises(grpc.RpcError) as e:
        list(getattr(stack.stub, rpc)(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"n must be in [1, {MAX_N}]" in e.value.details() and str(req.n) in e.value.details()


def test_a_client_id_cannot_take_a_live_derived_sequence_id(stack):
    long = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
    first = stack.stub.Generate(router_pb2.GenerateRequest(text=PROMPT, n=2, sampling=long, request_id="twins"),
                                timeout=120)
    next(first)  # both sequences are claimed before any token
    for clash, n in (("twins:1", 1), ("twins", 1), ("twins:0", 3)):
        with pytest.raises(grpc.RpcError) as e:
            list(stack.stub.Generate(router_pb2.GenerateRequest(text=PROMPT, n=n, request_id=clash), timeout=60))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, clash
        assert "is already live" in e.value.details()
    first.cancel()
    # Once the request is gone every id it held is free again.
    wait_until(lambda: _runs(stack, "twins:1"), timeout=30, what="the derived id to be free again")


def _runs(stack, request_id: str) -> bool:
    try:
        list(stack.stub.Generate(router_pb2.GenerateRequest(text=PROMPT, request_id=request_id,
                                                            sampling=common_pb2.SamplingParams(max_tokens=1)),
                                 timeout=60))
        return True
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
        return False


def test_n_in_an_inline_batch_request_is_refused_at_validation(stack):
    batch = stack.stub.CreateBatch(router_pb2.CreateBatchRequest(inline=router_pb2.BatchInlineRequests(requests=[
        router_pb2.BatchRequestItem(custom_id="three", generate=router_pb2.GenerateRequest(text=PROMPT, n=3)),
        router_pb2.BatchRequestItem(custom_id="one", generate=router_pb2.GenerateRequest(
            text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True)))])), timeout=30)
    terminal = (router_pb2.BATCH_STATUS_COMPLETED, router_pb2.BATCH_STATUS_FAILED)
    wait_until(lambda: stack.stub.GetBatch(router_pb2.GetBatchRequest(batch_id=batch.id)).status in terminal,
               timeout=120, what="the batch to finish")
    results = {r.custom_id: r for r in stack.stub.GetBatchResults(router_pb2.GetBatchResultsRequest(
        batch_id=batch.id), timeout=30)}
    assert results["three"].error.code == "invalid_request" and "n=3" in results["three"].error.message
    assert not results["three"].request_id  # never ran, not even as n = 1
    assert results["one"].response.usage.completion_tokens == 2


def _chat(stack, choice: router_pb2.ToolChoice, n: int = 0, **sampling) -> dict[int, list]:
    req = router_pb2.ChatRequest(messages=USER, tools=TOOLS, tool_choice=choice, n=n,
                                 sampling=common_pb2.SamplingParams(max_tokens=300, **sampling))
    return by_choice(stack.stub.Chat(req, timeout=300))


def check_calls(last, names: set[str]) -> list:
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP, last
    assert last.tool_calls and not last.text
    for i, call in enumerate(last.tool_calls):
        assert call.name in names and call.id == f"functions.{call.name}:{i}"
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return list(last.tool_calls)


def test_tool_choice_required_makes_the_random_model_call_tools_validly(stack):
    choices = _chat(stack, ToolChoice(mode=ToolChoice.MODE_REQUIRED), n=2, temperature=1.0, seed=3)
    assert sorted(choices) == [0, 1]
    for got in choices.values():
        check_calls(got[-1], {"get_weather", "ping"})


def test_tool_choice_naming_a_function_makes_exactly_one_call_to_it(stack):
    (got,) = _chat(stack, ToolChoice(mode=ToolChoice.MODE_FUNCTION, function_name="get_weather"),
                   temperature=0).values()
    assert [c.name for c in check_calls(got[-1], {"get_weather"})] == ["get_weather"]


@pytest.mark.parametrize("sampling, needle", [
    (common_pb2.SamplingParams(response_format=common_pb2.ResponseFormat(
        json_object=common_pb2.ResponseFormat.JsonObject())), "both constrain the reply"),
    (common_pb2.SamplingParams(response_format=common_pb2.ResponseFormat(
        tool_calls=common_pb2.ResponseFormat.ToolCalls(max_calls=1))), "set by the router"),
    (common_pb2.SamplingParams(ignore_eos=True), "ignore_eos cannot be combined with tool_choice 'required'"),
    (common_pb2.SamplingParams(min_tokens=3), "min_tokens cannot be combined with tool_choice 'required'"),
])
def test_tool_choice_constraints_cannot_be_mixed_or_forged(stack, sampling, needle):
    req = router_pb2.ChatRequest(messages=USER, tools=TOOLS, tool_choice=ToolChoice(mode=ToolChoice.MODE_REQUIRED),
                                 sampling=sampling)
    with pytest.raises(grpc.RpcError) as e:
        list(stack.stub.Chat(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
