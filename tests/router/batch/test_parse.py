"""Batch input parsing: which problems fail the whole batch and which fail one request (no network)."""

import json

import pytest

from kimiserve.v1 import common_pb2, router_pb2
from router.batch.parse import CHAT, GENERATE, INVALID, RESPONSES, parse_inline, parse_jsonl
from router.openai_responses import responses_request


def line(custom_id, url="/v1/completions", body=None, **extra):
    obj = {"custom_id": custom_id, "method": "POST", "url": url,
           "body": body if body is not None else {"prompt": "hi", "max_tokens": 3}}
    obj.update(extra)
    return json.dumps(obj)


def test_completion_and_chat_lines_become_requests():
    text = "\n".join([
        line("a", body={"prompt": "Hello", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
                        "seed": 7, "stop": "\n", "stop_token_ids": [3], "ignore_eos": True, "n": 1}),
        "",
        line("b", "/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                                        {"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                           "tools": [{"type": "function", "function": {"name": "f"}}],
                                           "max_completion_tokens": 2, "stream": False, "user": None}),
        line("c", body={"prompt": [1, 2, 3]}),
    ])
    parsed = parse_jsonl(text)
    assert parsed.issues == []
    a, b, c = parsed.requests
    assert (a.idx, a.custom_id, a.line, a.kind) == (0, "a", 1, GENERATE)
    ga = router_pb2.GenerateRequest.FromString(a.payload)
    assert ga.text == "Hello"
    assert ga.sampling == common_pb2.SamplingParams(max_tokens=4, temperature=0.5, top_p=0.9, top_k=5, seed=7,
                                                    stop=["\n"], stop_token_ids=[3], ignore_eos=True)
    assert (b.line, b.kind) == (3, CHAT)
    chat = router_pb2.ChatRequest.FromString(b.payload)
    assert [m.role for m in chat.messages] == ["system", "user"] and chat.messages[1].content == "x"
    assert json.loads(chat.tools[0].json)["function"]["name"] == "f"
    assert chat.sampling.max_tokens == 2
    assert list(router_pb2.GenerateRequest.FromString(c.payload).prompt_token_ids.ids) == [1, 2, 3]


def test_a_chat_line_carries_vllms_prefill_fields():
    """A line takes them as the HTTP API does; add_generation_prompt stays unset unless sent (the router decides)."""
    prefill = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure"}],
               "continue_final_message": True}
    requests = parse_jsonl("\n".join(line(f"c{i}", "/v1/chat/completions", body) for i, body in enumerate(
        [prefill, {**prefill, "add_generation_prompt": False}, {"messages": prefill["messages"][:1]}]))).requests
    chats = [router_pb2.ChatRequest.FromString(r.payload) for r in requests]
    assert [c.continue_final_message for c in chats] == [True, True, False]
    assert [c.HasField("add_generation_prompt") for c in chats] == [False, True, False]
    assert not chats[1].add_generation_prompt


def test_a_responses_line_is_kept_as_its_body_and_read_as_a_chat_request():
    body = {"input": [{"role": "user", "content": "x"}], "instructions": "be brief", "max_output_tokens": 2,
            "tools": [{"type": "function", "name": "f"}], "store": True}
    [r] = parse_jsonl(line("r", "/v1/responses", body)).requests
    assert r.kind == RESPONSES and json.loads(r.payload) == body
    chat, options = responses_request(json.loads(r.payload))
    assert [(m.role, m.content) for m in chat.messages] == [("system", "be brief"), ("user", "x")]
    assert chat.sampling.max_tokens == 2 and json.loads(chat.tools[0].json)["function"]["name"] == "f"
    assert options.echo.instructions == "be brief" and not options.stream


@pytest.mark.parametrize("body_line, fragment", [
    (line("x", "/v1/embeddings"), "unknown url '/v1/embeddings'; expected one of ['/v1/chat/completions', "
                                   "'/v1/completions', '/v1/responses']"),
    (line("x", "/v1/responses", {"input": "hi", "stream": True}), "unsupported body field(s) ['stream=True']"),
    (line("x", "/v1/responses", {"input": "hi", "include": ["message.output_text.logprobs"]}),
     "unsupported body field(s) ['include=message.output_text.logprobs']"),
    (line("x", "/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}), "responses are not stored"),
    (line("x", "/v1/responses", {"input": []}), "input must be a non-empty string"),
    (line("x", method="GET"), "method must be POST"),
    (line("x", body={"prompt": ""}), "prompt must be a non-empty string"),
    (line("x", body={"prompt": ["a", "b"]}), "one prompt per request"),
    (line("x", body={"prompt": "p", "temperature": "hot"}), "temperature must be a number"),
    (line("x", body={"prompt": "p", "max_tokens": 2.5}), "max_tokens must be an integer"),
    (line("x", body={"prompt": "p", "n": 3}), "unsupported body field(s) ['n=3']"),
    (line("x", body={"prompt": "p", "frobnicate": 1}), "unsupported body field(s) ['frobnicate']"),
    (line("x", "/v1/chat/completions", {"messages": []}), "messages must be a non-empty list"),
    (line("x", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}), "content must be"),
    (line("x", "/v1/chat/completions", {"messages": [{"role": "assistant"}], "continue_final_message": True}),
     "has no content to continue"),
    (line("x", "/v1/completions", {"prompt": "p", "continue_final_message": False}),
     "unsupported body field(s) ['continue_final_message']"),
    (json.dumps({"custom_id": "x", "url": "/v1/completions", "body": "text"}), "body must be a JSON object"),
])
def test_a_bad_request_fails_alone(body_line, fragment):
    parsed = parse_jsonl(line("ok") + "\n" + body_line + "\n" + line("ok2"))
    assert parsed.issues == []
    ok, bad, ok2 = parsed.requests
    assert ok.kind == ok2.kind == GENERATE
    assert bad.kind == INVALID and bad.error[0] == "invalid_request"
    assert fragment in bad.error[1] and "'x'" in bad.error[1] and "line 2" in bad.error[1]


@pytest.mark.parametrize("text, code, line_no", [
    (line("a") + "\n{not json\n", "invalid_json", 2),
    ("[1, 2]\n", "invalid_line", 1),
    (json.dumps({"url": "/v1/completions", "body": {}}), "missing_custom_id", 1),
    (json.dumps({"custom_id": 12, "body": {}}), "missing_custom_id", 1),
    (line("a") + "\n" + line("b") + "\n" + line("a"), "duplicate_custom_id", 3),
    ("\n  \n", "empty_input", 0),
    (line("a") + "\n" + '{"custom_id": "d", "body": ' + "[" * 5000 + "]" * 5000 + "}", "invalid_json", 2),
    (line("a") + "\n" + line("d", body={"prompt": "p", "x": json.loads("[" * 64 + "]" * 64)}), "invalid_json", 2),
])
def test_an_unusable_input_fails_the_batch(text, code, line_no):
    parsed = parse_jsonl(text)
    assert [i.code for i in parsed.issues] == [code]
    assert parsed.issues[0].line == line_no


def test_duplicate_message_names_both_lines():
    parsed = parse_jsonl("\n".join([line("dup-7"), line("b"), line("dup-7")]))
    assert "'dup-7' on line 3 was already used on line 1" in parsed.issues[0].message


def test_inline_requests():
    items = [router_pb2.BatchRequestItem(custom_id="g", generate=router_pb2.GenerateRequest(text="hi",
                                                                                           request_id="mine")),
             router_pb2.BatchRequestItem(custom_id="c", chat=router_pb2.ChatRequest(
                 messages=[common_pb2.ChatMessage(role="user", content="x")])),
             router_pb2.BatchRequestItem(custom_id="none")]
    parsed = parse_inline(items)
    g, c, none = parsed.requests
    assert (g.kind, c.kind, none.kind) == (GENERATE, CHAT, INVALID)
    assert not router_pb2.GenerateRequest.FromString(g.payload).HasField("request_id")
    assert none.error[0] == "invalid_request"
    dup = parse_inline(items + [router_pb2.BatchRequestItem(custom_id="g")])
    assert [i.code for i in dup.issues] == ["duplicate_custom_id"] and dup.issues[0].line == 4
    assert [i.code for i in parse_inline([router_pb2.BatchRequestItem()]).issues] == ["missing_custom_id"]


def test_a_lone_surrogate_escape_is_read_as_the_tokenizer_reads_it():
    """JSON may spell a lone surrogate ("\\udcff"), which protobuf cannot hold: it becomes U+FFFD (as Kimi's
    tiktoken encodes it), a pair of escapes the character it spells."""
    parsed = parse_jsonl(line("s", body={"prompt": "a\udcffb \ud83d\ude00", "stop": ["\udcff"]}))
    assert parsed.issues == [] and parsed.requests[0].kind == GENERATE
    req = router_pb2.GenerateRequest.FromString(parsed.requests[0].payload)
    assert req.text == "a\ufffdb \U0001F600" and list(req.sampling.stop) == ["\ufffd"]


def test_an_inline_request_with_n_choices_fails_alone_at_validation():
    items = [router_pb2.BatchRequestItem(custom_id="many", chat=router_pb2.ChatRequest(
                 n=2, messages=[common_pb2.ChatMessage(role="user", content="x")])),
             router_pb2.BatchRequestItem(custom_id="one", generate=router_pb2.GenerateRequest(text="hi", n=1))]
    many, one = parse_inline(items).requests
    assert many.kind == INVALID and many.error[0] == "invalid_request" and "n=2" in many.error[1]
    assert one.kind == GENERATE


def test_a_jsonl_line_with_n_choices_fails_alone():
    line = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi", "n": 2}})
    (req,) = parse_jsonl(line).requests
    assert req.kind == INVALID and "n=2" in req.error[1]

