"""A reply that thinks, end to end: a scripted checkpoint (tests/scripted_model.py) answers every chat with
<think>, two tokens, </think>, one token and end-of-turn, so what each API must report is known before it runs:
reasoning and content split apart, and usage counting the thinking block's tokens (markers included) as
reasoning_tokens, in chat (whole, streamed, n > 1), Responses (whose logprobs leave the block out), gRPC Chat and a
reply cut inside the block; and the reply sent back in the conversation with its reasoning, as agents do."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
from tokenizers import Tokenizer

from kimiserve.v1 import common_pb2, router_pb2
from tests.scripted_model import scripted_stack, write_scripted_model

WORDS = (300, 301, 302)  # ordinary tokens of the tiny tokenizer: two thought, one said
USER = [{"role": "user", "content": "Hello"}]
# <think> A B </think> C <|im_end|>: six tokens, the first four the thinking block.
REPLY_TOKENS, THINKING_TOKENS = 6, 4


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    model = tmp_path_factory.mktemp("scripted") / "thinker"
    # A chat prompt ends with <|im_middle|> (the assistant's turn opens); from there the reply is fixed.
    write_scripted_model(model, ["<|im_middle|>", "<think>", *WORDS[:2], "</think>", WORDS[2], "<|im_end|>"])
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    with scripted_stack(model) as stack:
        thought = tok.decode(list(WORDS[:2]))
        yield stack | {"thought": thought, "said": tok.decode([WORDS[2]]),
                       "block_tokens": len(tok.encode(f"<think>{thought}</think>", add_special_tokens=False).ids)}


def test_chat_splits_the_thinking_and_counts_its_tokens(thinking):
    r = thinking["openai"].chat.completions.create(model="", messages=USER, max_tokens=16, temperature=0)
    [choice] = r.choices
    assert (choice.message.reasoning_content, choice.message.content, choice.finish_reason) == (
        thinking["thought"], thinking["said"], "stop")
    assert r.usage.completion_tokens == REPLY_TOKENS
    assert r.usage.completion_tokens_details.reasoning_tokens == THINKING_TOKENS


def test_streamed_chat_and_n_choices_count_the_same(thinking):
    chunks = list(thinking["openai"].chat.completions.create(
        model="", messages=USER, max_tokens=16, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True}))
    reasoning = {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            reasoning[c.index] += getattr(c.delta, "reasoning_content", None) or ""
    assert reasoning == {0: thinking["thought"], 1: thinking["thought"]}
    usage = chunks[-1].usage
    assert (usage.completion_tokens, usage.completion_tokens_details.reasoning_tokens) == (
        2 * REPLY_TOKENS, 2 * THINKING_TOKENS)


def test_a_reply_cut_inside_the_block_is_all_reasoning(thinking):
    r = thinking["openai"].chat.completions.create(model="", messages=USER, max_tokens=3, temperature=0)
    assert (r.choices[0].finish_reason, r.choices[0].message.content) == ("length", "")  # as OpenAI answers it
    assert r.usage.completion_tokens == r.usage.completion_tokens_details.reasoning_tokens == 3


def test_responses_report_the_reasoning_item_and_its_tokens(thinking):
    r = thinking["openai"].responses.create(model=thinking["model"], input="Hello", max_output_tokens=16,
                                            temperature=0)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == thinking["thought"] and r.output_text == thinking["said"]
    assert (r.usage.output_tokens, r.usage.output_tokens_details.reasoning_tokens) == (REPLY_TOKENS,
                                                                                       THINKING_TOKENS)


def test_responses_logprobs_cover_the_tokens_after_the_thinking_block(thinking):
    kw = dict(model=thinking["model"], input="Hello", max_output_tokens=16, temperature=0,
              include=["message.output_text.logprobs"])
    whole = thinking["openai"].responses.create(**kw)
    [part] = whole.output[1].content
    said = [t.token for t in part.logprobs]
    assert said == [thinking["said"], "<|im_end|>"], said  # the last word and the end of turn, nothing thought
    with thinking["openai"].responses.stream(**kw) as stream:
        deltas = [t.token for e in stream if e.type == "response.output_text.delta" for t in e.logprobs]
    assert deltas == said


def test_grpc_chat_usage_counts_reasoning_tokens(thinking):
    req = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="Hello")],
                                 sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0))
    got = list(thinking["grpc"].Chat(req, timeout=60))
    assert "".join(c.reasoning_text for c in got) == thinking["thought"]
    assert "".join(c.text for c in got) == thinking["said"]
    assert (got[-1].usage.completion_tokens, got[-1].usage.reasoning_tokens) == (REPLY_TOKENS, THINKING_TOKENS)


def test_the_chat_cli_shows_the_thinking_on_stderr_and_the_answer_on_stdout(thinking):
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "chat", "Hello", "--temperature", "0", "--router",
                          thinking["router"]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == thinking["said"] + "\n"
    assert thinking["thought"] + "\n" in out.stderr


def test_a_completion_has_no_reasoning_tokens(thinking):
    said = thinking["openai"].completions.create(model="", prompt=[WORDS[2]], max_tokens=4, temperature=0)
    assert said.usage.completion_tokens == 1  # <|im_end|> follows the last word
    assert said.usage.completion_tokens_details.reasoning_tokens == 0


CALL = {"id": "functions.ping:0", "type": "function", "function": {"name": "ping", "arguments": "{}"}}
RESULT = {"role": "tool", "tool_call_id": "functions.ping:0", "content": "pong"}
LATER = {"role": "user", "content": "And then?"}


def prompt_tokens(thinking, messages) -> int:
    return thinking["openai"].chat.completions.create(model="", messages=messages, max_tokens=1,
                                                      temperature=0).usage.prompt_tokens


def test_a_reply_sent_back_with_its_reasoning_is_read_as_the_model_wrote_it(thinking):
    """The SDK's message, dumped as agents append it (reasoning_content included), is accepted. In the exchange
    still going on (after the last user message: a tool-call loop) its thinking is rendered back, block and all;
    before a later user message it is left out. vLLM's newer name, reasoning, reads the same."""
    reply = thinking["openai"].chat.completions.create(model="", messages=USER, max_tokens=16,
                                                       temperature=0).choices[0].message
    echoed = reply.model_dump(exclude_none=True)
    assert echoed == {"role": "assistant", "content": thinking["said"], "reasoning_content": thinking["thought"]}
    plain = {"role": "assistant", "content": reply.content}
    assert prompt_tokens(thinking, USER + [echoed, LATER]) == prompt_tokens(thinking, USER + [plain, LATER])
    loop = prompt_tokens(thinking, USER + [echoed | {"tool_calls": [CALL]}, RESULT])
    assert loop - prompt_tokens(thinking, USER + [plain | {"tool_calls": [CALL]}, RESULT]) == thinking["block_tokens"]
    vllm = plain | {"tool_calls": [CALL], "reasoning": thinking["thought"]}
    assert prompt_tokens(thinking, USER + [vllm, RESULT]) == loop


@pytest.mark.parametrize("message, param, needle", [
    ({"role": "user", "content": "x", "reasoning_content": "y"}, "messages", "cannot carry reasoning_content"),
    ({"role": "assistant", "content": "x", "reasoning_content": "a", "reasoning": "b"}, "messages[1]", "differ"),
])
def test_reasoning_where_it_cannot_be_is_refused(thinking, message, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        prompt_tokens(thinking, USER + [message])
    assert e.value.body["param"] == param and needle in e.value.body["message"]


def test_responses_take_their_own_output_items_back_as_input(thinking):
    """A response's items replayed as input (reasoning, then the message) make one assistant turn, read as chat
    reads the same conversation; a reasoning item before a function call keeps its thinking in the loop."""
    client, model = thinking["openai"], thinking["model"]
    first = client.responses.create(model=model, input="Hello", max_output_tokens=16, temperature=0)
    items = [item.model_dump(exclude_none=True) for item in first.output]
    assert [item["type"] for item in items] == ["reasoning", "message"]
    user = {"role": "user", "content": "Hello"}
    later = client.responses.create(model=model, input=[user, *items, LATER], max_output_tokens=1, temperature=0)
    plain = {"role": "assistant", "content": thinking["said"]}
    assert later.usage.input_tokens == prompt_tokens(thinking, USER + [plain, LATER])
    call = {"type": "function_call", "call_id": CALL["id"], "name": "ping", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": CALL["id"], "output": "pong"}
    loop = client.responses.create(model=model, input=[user, items[0], call, output], max_output_tokens=1,
                                   temperature=0, tools=[{"type": "function", "name": "ping", "parameters": {}}])
    bare = thinking["openai"].chat.completions.create(
        model="", messages=USER + [{"role": "assistant", "content": "", "tool_calls": [CALL]}, RESULT], max_tokens=1,
        temperature=0, tools=[{"type": "function", "function": {"name": "ping", "parameters": {}}}])
    assert loop.usage.input_tokens - bare.usage.prompt_tokens == thinking["block_tokens"] > 0


def test_sealed_reasoning_alone_comes_back_as_the_turns_thinking(thinking):
    """include reasoning.encrypted_content (what agent SDKs add with store: false): the reasoning item carries its
    text sealed, streamed or not, and an item holding only that seal is read back as its thinking; another
    server's encrypted_content alone is refused naming the item."""
    client, model = thinking["openai"], thinking["model"]
    kw = dict(model=model, input="Hello", max_output_tokens=16, temperature=0, include=["reasoning.encrypted_content"])
    sealed = client.responses.create(**kw).output[0].encrypted_content
    assert sealed
    with client.responses.stream(**kw) as stream:
        done = [e.item for e in stream if e.type == "response.output_item.done" and e.item.type == "reasoning"]
    assert [item.encrypted_content for item in done] == [sealed]
    call = {"type": "function_call", "call_id": CALL["id"], "name": "ping", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": CALL["id"], "output": "pong"}
    tools = [{"type": "function", "name": "ping", "parameters": {}}]

    def input_tokens(reasoning: dict) -> int:
        return client.responses.create(model=model, input=[{"role": "user", "content": "Hello"}, reasoning, call,
                                                           output], max_output_tokens=1, temperature=0,
                                       tools=tools).usage.input_tokens
    with_text = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                                   "text": thinking["thought"]}]}
    assert input_tokens({"type": "reasoning", "summary": [], "encrypted_content": sealed}) == input_tokens(with_text)
    with pytest.raises(openai.BadRequestError) as e:
        input_tokens({"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB-someone-elses"})
    assert e.value.body["param"] == "input[1].content"
