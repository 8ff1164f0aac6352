"""vLLM's POST /tokenize and /detokenize at the server root, with httpx and curl: a prompt's ids are the tokenizer
service's own and the ones /v1/completions prefills (its usage, its echoed tokens, the same greedy reply when sent as
ids); a chat's are the tokenizer's RenderChat and /v1/chat/completions' usage; /detokenize inverts them; bad bodies
are 400s naming the field, and the API key and model checks are the other endpoints'."""

from __future__ import annotations

import json
import subprocess

import grpc
import httpx
import pytest

from kimiserve.limits import MAX_CHAT_MESSAGES
from kimiserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.ci_tools import debian_tool
from tests.router.http.conftest import API_KEY, MAX_MODEL_LEN
from tests.router.http.test_errors_auth import assert_error, post

TEXT = "Once upon a time, there was a tiny model that counted its tokens."
HELLO = [{"role": "user", "content": "Hello"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a token?"}]
PREFILL = [*CHAT, {"role": "assistant", "content": "A token is"}]


@pytest.fixture(scope="module")
def tokenizer(http_stack):
    with grpc.insecure_channel(http_stack.children["tokenizer"].address) as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"]
    return resp.json()


def tokenized(http_stack, **body) -> dict:
    reply = ok(post(http_stack, "/tokenize", body))
    assert reply["count"] == len(reply["tokens"]) and reply["max_model_len"] == MAX_MODEL_LEN
    return reply


def rendered(tokenizer, messages: list[dict], tools: list[dict] = (), **flags) -> tokenizer_pb2.RenderChatResponse:
    return tokenizer.RenderChat(tokenizer_pb2.RenderChatRequest(
        messages=[common_pb2.ChatMessage(**m) for m in messages],
        tools=[common_pb2.Tool(json=json.dumps(t)) for t in tools], **flags), timeout=30)


def test_a_prompt_has_the_ids_a_completion_prefills(http_stack, tokenizer):
    reply = tokenized(http_stack, model=http_stack.model, prompt=TEXT)
    ids = reply["tokens"]
    assert set(reply) == {"count", "max_model_len", "tokens"}
    assert ids == list(tokenizer.Tokenize(tokenizer_pb2.TokenizeRequest(text=TEXT), timeout=30).token_ids)
    for special in (True, False):  # the tokenizer adds no special tokens of its own: the same ids either way
        assert tokenized(http_stack, prompt=TEXT, add_special_tokens=special)["tokens"] == ids
    c = http_stack.client.completions
    as_text = c.create(model="", prompt=TEXT, max_tokens=4, temperature=0, echo=True, logprobs=0,
                       extra_body={"ignore_eos": True})
    assert as_text.usage.prompt_tokens == len(ids)
    strs = tokenized(http_stack, prompt=TEXT, return_token_strs=True)["token_strs"]
    assert as_text.choices[0].logprobs.tokens[:len(ids)] == strs and "".join(strs) == TEXT
    as_ids = c.create(model="", prompt=ids, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert as_ids.choices[0].text == as_text.choices[0].text[len(TEXT):]
    assert tokenized(http_stack, prompt="")["tokens"] == []  # a completion refuses it; counting it is fine


@pytest.mark.parametrize("messages, tools, flags", [
    (HELLO, [], {}),
    (CHAT, TOOLS, {}),
    (CHAT, [], {"add_generation_prompt": False}),
    (PREFILL, [], {"continue_final_message": True}),
])
def test_a_chat_has_the_ids_a_chat_completion_prefills(http_stack, tokenizer, messages, tools, flags):
    reply = tokenized(http_stack, messages=messages, tools=tools, **flags)
    want = rendered(tokenizer, messages, tools, **flags)
    assert reply["tokens"] == list(want.token_ids)
    completion = http_stack.client.chat.completions.create(model="", messages=messages, tools=tools or None,
                                                           max_tokens=1, extra_body=flags)
    assert completion.usage.prompt_tokens == reply["count"]
    # Special tokens are kept: the ids read back as the rendered prompt the model sees.
    assert ok(post(http_stack, "/detokenize", {"tokens": reply["tokens"]}))["prompt"] == want.prompt


@pytest.mark.parametrize("text", [TEXT, "naïve café: 1 + 1 = 2, ✓ 你好", " leading and trailing spaces  "])
def test_detokenize_inverts_tokenize(http_stack, text):
    ids = tokenized(http_stack, prompt=text)["tokens"]
    assert ok(post(http_stack, "/detokenize", {"model": http_stack.model, "tokens": ids})) == {"prompt": text}
    assert ok(post(http_stack, "/detokenize", {"tokens": []})) == {"prompt": ""}


def test_curl(http_stack):
    curl = debian_tool("curl", "curl")

    def call(path: str, body: dict) -> dict:
        out = subprocess.run([curl, "-sS", "--fail-with-body", f"{http_stack.base}{path}",
                              "-H", f"Authorization: Bearer {API_KEY}", "-H", "Content-Type: application/json",
                              "-d", json.dumps(body)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)

    reply = call("/tokenize", {"model": http_stack.model, "prompt": TEXT})
    assert reply["count"] == len(reply["tokens"]) > 0 and reply["max_model_len"] == MAX_MODEL_LEN
    assert call("/detokenize", {"tokens": reply["tokens"]}) == {"prompt": TEXT}


VOCAB_PAST = 1 << 20  # past any tiny model's vocabulary


@pytest.mark.parametrize("path, body, param, fragment", [
    ("/tokenize", {}, "prompt", "either prompt"),
    ("/tokenize", {"model": "", "prompt": None, "messages": None}, "prompt", "either prompt"),
    ("/tokenize", {"prompt": "x", "messages": HELLO}, "messages", "not both"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt", "prompt must be a string"),
    ("/tokenize", {"prompt": "x", "model": 7}, "model", "model must be a string"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", "unsupported"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, "return_token_strs", "true or false"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 1}, "add_special_tokens", "must be a boolean"),
    ("/tokenize", {"messages": []}, "messages", "non-empty list"),
    ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    ("/tokenize", {"messages": HELLO, "chat_template": "{{ messages }}"}, "chat_template", "tokenizer service's"),
    ("/tokenize", {"messages": HELLO, "add_generation_prompt": True, "continue_final_message": True},
     "add_generation_prompt", "cannot be combined with continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": ""}] * (MAX_CHAT_MESSAGES + 1)}, "messages",
     "over the limit"),
    ("/detokenize", {}, "tokens", "tokens must be a list"),
    ("/detokenize", {"tokens": "1, 2"}, "tokens", "tokens must be a list"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens", "tokens[1] must be a token id"),
    ("/detokenize", {"tokens": [1, 2.0]}, "tokens", "tokens[1] must be a token id"),
    ("/detokenize", {"tokens": [True]}, "tokens", "tokens[0] must be a token id"),
    ("/detokenize", {"tokens": [1, VOCAB_PAST, -3]}, "tokens", "2 token ids outside [0, vocab size"),
    ("/detokenize", {"tokens": [1, VOCAB_PAST, -3]}, "tokens", f"first: [{VOCAB_PAST}, -3]"),  # the ids at fault
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt", "unsupported"),
])
def test_bad_bodies_are_400_naming_the_field(http_stack, path, body, param, fragment):
    error = assert_error(post(http_stack, path, body), 400, "invalid_argument", param)
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": TEXT}), ("/tokenize", {"messages": HELLO}),
                                        ("/detokenize", {"tokens": [1, 2]})])
def test_api_key_and_model_are_checked_as_elsewhere(http_stack, path, body):
    for key in (None, "wrong-key"):
        assert_error(post(http_stack, path, body, key=key), 401, "invalid_api_key")
    error = assert_error(post(http_stack, path, {**body, "model": "gpt-9"}), 404, "not_found")
    assert "'gpt-9'" in error["message"] and repr(http_stack.model) in error["message"]
    if "prompt" in body:
        assert_error(post(http_stack, path, {"prompt": "", "model": "gpt-9"}), 404, "not_found")
