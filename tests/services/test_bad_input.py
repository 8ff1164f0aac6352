"""Bad input gets INVALID_ARGUMENT with a message that says what is wrong, and the stack keeps serving."""

from __future__ import annotations

import grpc
import pytest

from kimiserve.v1 import common_pb2, router_pb2
from tests.services.helpers import generate


def gen_request(ids=None, text=None, **sampling):
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling))
    if text is not None:
        req.text = text
    if ids is not None:
        req.prompt_token_ids.CopyFrom(common_pb2.TokenIds(ids=ids))
    return req


def chat_request(messages, tools=()):
    return router_pb2.ChatRequest(messages=messages, tools=list(tools),
                                  sampling=common_pb2.SamplingParams(max_tokens=2))


GENERATE_CASES = {
    "empty text": (gen_request(text="", max_tokens=2), "empty"),
    "empty ids": (gen_request(ids=[], max_tokens=2), "prompt"),
    "no prompt": (router_pb2.GenerateRequest(), "prompt"),
    "longer than context": (gen_request(ids=[5] * 600, max_tokens=2), "context"),
    "max_tokens zero": (gen_request(ids=[5], max_tokens=0), "max_tokens"),
    "max_tokens negative": (gen_request(ids=[5], max_tokens=-3), "max_tokens"),
    "id past vocab": (gen_request(ids=[5, 1024], max_tokens=2), "1024"),
    "bad top_p": (gen_request(ids=[5], max_tokens=2, top_p=1.5), "top_p"),
    "negative temperature": (gen_request(ids=[5], max_tokens=2, temperature=-1), "temperature"),
}
CHAT_CASES = {
    "unknown role": (chat_request([common_pb2.ChatMessage(role="wizard", content="hi")]), "wizard"),
    "malformed tool json": (chat_request([common_pb2.ChatMessage(role="user", content="hi")],
                                         [common_pb2.Tool(json="{not json")]), "tools[0]"),
    "tool call arguments not json": (chat_request([
        common_pb2.ChatMessage(role="user", content="hi"),
        common_pb2.ChatMessage(role="assistant", tool_calls=[common_pb2.ToolCall(name="f", arguments="{oops")])]),
        "messages[1]"),
    "oversized message": (chat_request([common_pb2.ChatMessage(role="user", content="x" * 1_200_000)]),
                          "messages[0]"),
    "no messages": (chat_request([]), "messages"),
}


def _assert_still_serving(stack):
    ids, _, last = generate(stack.stub, ids=[1, 2, 3], max_tokens=2, temperature=0.0, ignore_eos=True)
    assert len(ids) == 2 and last.usage.completion_tokens == 2


@pytest.mark.parametrize("case", GENERATE_CASES)
def test_generate_rejects(stack, case):
    req, needle = GENERATE_CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub.Generate(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()
    _assert_still_serving(stack)


@pytest.mark.parametrize("case", CHAT_CASES)
def test_chat_rejects(stack, case):
    req, needle = CHAT_CASES[case]
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub.Chat(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert needle in info.value.details()
    _assert_still_serving(stack)


@pytest.mark.parametrize("method", ["Generate", "Chat"])
def test_unknown_model_is_not_found(stack, method):
    if method == "Generate":
        call = stack.stub.Generate(router_pb2.GenerateRequest(model="no-such-model", text="hi",
                                                              sampling=common_pb2.SamplingParams(max_tokens=2)))
    else:
        req = chat_request([common_pb2.ChatMessage(role="user", content="hi")])
        req.model = "no-such-model"
        call = stack.stub.Chat(req)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in info.value.details()
    _assert_still_serving(stack)
