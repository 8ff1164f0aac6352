"""vLLM's assistant prefill on /v1/chat/completions (`continue_final_message`, `add_generation_prompt`) through the
official SDK and over gRPC Chat: the model continues the final assistant message, and what it generates is exactly
what the same greedy model generates for a prompt built by hand from the tokenizer service's ordinary rendering (the
conversation before the prefill, with its generation prompt, then the prefill's own ids), so neither the rendering
nor the reply is checked against the code under test. The refusals name the field."""

from __future__ import annotations

import grpc
import openai
import pytest

from kimiserve.v1 import common_pb2, router_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from router.prompts import CHAT_VISIBLE_SPECIALS

HEADER = "<|im_assistant|>assistant<|im_middle|>"  # the Kimi format's assistant turn header (docs/models.md)
PREFILL = '{"answer":'
MESSAGES = [{"role": "system", "content": "Reply in JSON."}, {"role": "user", "content": "What is the capital?"},
            {"role": "assistant", "content": PREFILL}]
TOKENS = 8


@pytest.fixture(scope="module")
def tokenizer(http_stack):
    with grpc.insecure_channel(http_stack.children["tokenizer"].address) as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)


def pb_messages(messages: list[dict]) -> list[common_pb2.ChatMessage]:
    return [common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def ids_of(tokenizer, text: str) -> list[int]:
    return list(tokenizer.Tokenize(tokenizer_pb2.TokenizeRequest(text=text), timeout=30).token_ids)


def rendered(tokenizer, messages: list[dict]) -> list[int]:
    """The tokenizer's ordinary rendering: the conversation and the generation prompt after it."""
    request = tokenizer_pb2.RenderChatRequest(messages=pb_messages(messages))
    return list(tokenizer.RenderChat(request, timeout=30).token_ids)


def greedy_generate(http_stack, ids: list[int]) -> list[int]:
    req = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(
        max_tokens=TOKENS, temperature=0, ignore_eos=True))
    chunks = http_stack.grpc.Generate(req, metadata=http_stack.auth, timeout=120)
    return [t for chunk in chunks for t in chunk.token_ids]


def greedy_chat(http_stack, messages: list[dict], **fields) -> tuple[list[int], str, common_pb2.Usage]:
    req = router_pb2.ChatRequest(messages=pb_messages(messages), sampling=common_pb2.SamplingParams(
        max_tokens=TOKENS, temperature=0, ignore_eos=True), **fields)
    chunks = list(http_stack.grpc.Chat(req, metadata=http_stack.auth, timeout=120))
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].usage


def sdk_chat(http_stack, messages: list[dict], stream: bool = False, **extra):
    """extra: fields the SDK does not type, sent as they are."""
    return http_stack.client.chat.completions.create(model="", messages=messages, max_tokens=TOKENS, temperature=0,
                                                     stream=stream, extra_body={"ignore_eos": True, **extra})


def test_the_model_continues_the_final_assistant_message(http_stack, tokenizer):
    head, header = rendered(tokenizer, MESSAGES[:-1]), ids_of(tokenizer, HEADER)
    assert head[-len(header):] == header  # the assistant turn the prefill goes into is opened
    by_hand = head + ids_of(tokenizer, PREFILL)
    want = greedy_generate(http_stack, by_hand)

    ids, text, usage = greedy_chat(http_stack, MESSAGES, continue_final_message=True)
    assert ids == want and usage.prompt_tokens == len(by_hand)
    reply = sdk_chat(http_stack, MESSAGES, continue_final_message=True)
    assert reply.usage.prompt_tokens == len(by_hand) and reply.usage.completion_tokens == TOKENS
    assert reply.choices[0].message.content == text  # the new text alone: the same flow's, not the prefill's
    # Both replies leave special tokens out, but chat's thinking and tool-call markers, which it reads instead.
    markers = {t.id for t in tokenizer.Info(tokenizer_pb2.TokenizerInfoRequest(), timeout=30).special_tokens
               if t.content in CHAT_VISIBLE_SPECIALS}
    assert not markers & set(want), "a marker would read differently in chat and completions: change PREFILL"
    completion = http_stack.client.completions.create(model="", prompt=by_hand, max_tokens=TOKENS, temperature=0,
                                                      extra_body={"ignore_eos": True})
    assert completion.choices[0].text == reply.choices[0].message.content
    streamed = sdk_chat(http_stack, MESSAGES, continue_final_message=True, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    # add_generation_prompt false is what continue_final_message implies; the reply is the same
    assert sdk_chat(http_stack, MESSAGES, continue_final_message=True,
                    add_generation_prompt=False).choices[0].message.content == text
    # text parts are text content too
    parts = [*MESSAGES[:-1], {"role": "assistant", "content": [{"type": "text", "text": PREFILL[:5]},
                                                               {"type": "text", "text": PREFILL[5:]}]}]
    assert sdk_chat(http_stack, parts, continue_final_message=True).choices[0].message.content == text


def test_without_the_generation_prompt_nothing_is_appended(http_stack, tokenizer):
    """add_generation_prompt false without continue_final_message: the ordinary rendering less its assistant
    header (vLLM allows it; the model writes whatever follows a closed turn)."""
    messages = MESSAGES[:-1]
    header, ordinary = ids_of(tokenizer, HEADER), rendered(tokenizer, messages)
    by_hand = ordinary[:-len(header)]
    ids, _, usage = greedy_chat(http_stack, messages, add_generation_prompt=False)
    assert ids == greedy_generate(http_stack, by_hand) and usage.prompt_tokens == len(by_hand)
    assert sdk_chat(http_stack, messages, add_generation_prompt=False).usage.prompt_tokens == len(by_hand)
    assert sdk_chat(http_stack, messages, add_generation_prompt=True).usage.prompt_tokens == len(ordinary)


CALL = {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
REFUSED = {
    "last message not assistant": (MESSAGES[:-1], {"continue_final_message": True}, "continue_final_message",
                                   "has role 'user'"),
    "tool_calls": ([*MESSAGES[:-1], {"role": "assistant", "content": "x", "tool_calls": [CALL]}],
                   {"continue_final_message": True}, "continue_final_message", "has tool_calls"),
    "no content": ([*MESSAGES[:-1], {"role": "assistant", "content": None}], {"continue_final_message": True},
                   "continue_final_message", "no content to continue"),
    "both true": (MESSAGES, {"continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt",
                  "cannot be combined with continue_final_message"),
    "continue not a bool": (MESSAGES, {"continue_final_message": "yes"}, "continue_final_message",
                            "must be true or false"),
    "add_generation_prompt not a bool": (MESSAGES, {"add_generation_prompt": 1}, "add_generation_prompt",
                                         "must be true or false"),
}


@pytest.mark.parametrize("messages, extra, param, why", list(REFUSED.values()), ids=list(REFUSED))
def test_what_cannot_be_continued_is_a_400_naming_the_field(http_stack, messages, extra, param, why):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk_chat(http_stack, messages, **extra)
    error = refused.value.body
    assert error["param"] == param and why in error["message"], error


def test_completions_and_responses_refuse_the_chat_only_fields(http_stack):
    """Refused, never ignored: neither endpoint has a chat turn of the client's to leave open."""
    client = http_stack.client
    for field in ("continue_final_message", "add_generation_prompt"):
        for create in (lambda body: client.completions.create(model="", prompt="Hi", max_tokens=1, extra_body=body),
                       lambda body: client.responses.create(model="", input="Hi", max_output_tokens=1,
                                                            extra_body=body)):
            with pytest.raises(openai.BadRequestError) as refused:
                create({field: False})
            assert refused.value.body["param"] == field


def test_grpc_refuses_with_invalid_argument_naming_the_field(http_stack):
    for messages, fields, name in ((MESSAGES[:-1], dict(continue_final_message=True), "continue_final_message"),
                                   (MESSAGES, dict(continue_final_message=True, add_generation_prompt=True),
                                    "add_generation_prompt")):
        with pytest.raises(grpc.RpcError) as refused:
            greedy_chat(http_stack, messages, **fields)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith(f"{name}: "), refused.value.details()
