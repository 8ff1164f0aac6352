"""Traces across the three services: a stack exporting to a local OTLP receiver through the standard OTEL_* variables.

One chat request must arrive as one trace: the router's spans (admission, render_chat, route, stream), the
tokenizer's (RenderChat, DetokenizeStream) and the shard's (queue, one prefill span per prefill pass, decode), joined
parent to child across the processes, every span carrying the request id, and the client's own traceparent as the
root's parent. The same holds for a request to the HTTP API, whose root span is the HTTP request's.
"""

from __future__ import annotations

import os
import secrets

import httpx
import pytest

from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, router_pb2
from launcher.up import start_stack
from tests.services.conftest import Stack
from tests.services.otlp_receiver import OtlpReceiver, ReceivedSpan, render_tree

PREFILL_BUDGET = 16  # tokens per prefill pass: the chat prompt below takes several passes
RID = "request_id"
OTEL_ENV = {"OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def traced_stack(tiny_k3, receiver):
    http_port = free_port()
    env = {**OTEL_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the services are child processes: they inherit the environment at start
    try:
        s = Stack(start_stack(tiny_k3, 1, "cpu", "127.0.0.1", free_port(), timeout=180,
                              shard_args=("--num-state-slots", "4", "--num-kv-blocks", "256", "--max-model-len", "512",
                                          "--prefill-token-budget", str(PREFILL_BUDGET)),
                              router_args=("--http-port", str(http_port))))
        s.http = f"http://127.0.0.1:{http_port}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    yield s
    s.close()


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    hits = by_name(spans, name)
    assert len(hits) == 1, f"expected one {name!r} span, got {len(hits)}:\n{render_tree(spans)}"
    return hits[0]


def assert_child(parent: ReceivedSpan, child: ReceivedSpan, spans: list[ReceivedSpan]) -> None:
    assert child.parent_id == parent.span_id, f"{child.name} is not a child of {parent.name}:\n{render_tree(spans)}"
    slack = 5_000_000  # 5 ms: the processes convert their monotonic clocks to wall time each on their own
    assert parent.start_ns - slack <= child.start_ns and child.end_ns <= parent.end_ns + slack, (parent, child)


def test_one_chat_request_is_one_trace_across_the_three_services(traced_stack, receiver):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    rid = f"traced-chat-{secrets.token_hex(4)}"
    # A prompt of several prefill passes, new to the shard's prefix cache.
    text = f"{secrets.token_hex(4)} " + " ".join(f"w{i}" for i in range(8))
    chunks = list(traced_stack.stub.Chat(router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content=text)],
        sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)),
        metadata=(("x-request-id", rid), ("traceparent", f"00-{trace_id}-{client_span}-01")), timeout=120))
    usage = chunks[-1].usage
    assert usage.completion_tokens == 5 and usage.prompt_tokens > 2 * PREFILL_BUDGET

    wanted = {"router.Chat", "render_chat", "tokenizer.RenderChat", "admission", "route", "stream", "shard.sequence",
              "queue", "prefill", "decode", "tokenizer.DetokenizeStream"}
    spans = receiver.trace(trace_id, lambda got: wanted <= {s.name for s in got})
    tree = render_tree(spans, ("tokens", "pass_tokens", "chunks"))
    assert {s.service for s in spans} == {"kimiserve-router", "kimiserve-tokenizer", "kimiserve-shard"}, tree
    assert all(s.attributes.get("kimiserve.request_id") == rid for s in spans), tree

    root = one(spans, "router.Chat")
    assert root.parent_id == client_span, tree  # the client's traceparent is the parent of the router's span
    assert root.attributes["finish_reason"] == "length" and root.attributes["completion_tokens"] == 5
    for name in ("render_chat", "admission", "route", "stream"):
        assert_child(root, one(spans, name), spans)
    assert_child(one(spans, "render_chat"), one(spans, "tokenizer.RenderChat"), spans)
    stream = one(spans, "stream")
    assert_child(stream, one(spans, "tokenizer.DetokenizeStream"), spans)
    shard = one(spans, "shard.sequence")
    assert_child(stream, shard, spans)
    assert shard.attributes["prompt_tokens"] == usage.prompt_tokens

    for name in ("queue", "decode"):
        assert_child(shard, one(spans, name), spans)
    prefills = sorted(by_name(spans, "prefill"), key=lambda s: s.start_ns)
    for p in prefills:
        assert_child(shard, p, spans)
        assert p.attributes["chunks"] == 1 and p.attributes["tokens"] <= PREFILL_BUDGET
    # Each pass the prompt was in, in order: their tokens add up to the prompt, and the first token follows them.
    assert len(prefills) == shard.attributes["prefill_passes"] >= 3, tree
    assert sum(p.attributes["tokens"] for p in prefills) == usage.prompt_tokens, tree
    assert all(a.end_ns <= b.start_ns for a, b in zip(prefills, prefills[1:])), tree
    assert one(spans, "queue").end_ns <= prefills[0].start_ns + 5_000_000
    assert one(spans, "decode").attributes["tokens"] == 4


def test_a_request_without_client_context_starts_its_own_trace(traced_stack, receiver):
    rid = f"traced-gen-{secrets.token_hex(4)}"
    sampling = common_pb2.SamplingParams(max_tokens=1, ignore_eos=True)  # sampled: EOS first would end it "stop"
    chunks = list(traced_stack.stub.Generate(router_pb2.GenerateRequest(
        request_id=rid, text="hello there", sampling=sampling), timeout=120))
    assert chunks[-1].usage.completion_tokens == 1

    wanted = {"router.Generate", "tokenize", "tokenizer.Tokenize", "shard.sequence", "prefill"}
    spans = receiver.wait(lambda got: wanted <= {s.name for s in got},
                          lambda s: s.attributes.get("kimiserve.request_id") == rid)
    root = one(spans, "router.Generate")
    assert root.parent_id == "" and root.attributes["finish_reason"] == "length"
    assert {s.trace_id for s in spans} == {root.trace_id}
    assert_child(root, one(spans, "tokenize"), spans)
    assert_child(one(spans, "tokenize"), one(spans, "tokenizer.Tokenize"), spans)
    assert one(spans, "shard.sequence").attributes["completion_tokens"] == 1
    assert not by_name(spans, "decode")  # max_tokens 1: the first token ends it at prefill



def test_an_http_request_is_one_trace_rooted_at_the_http_span(traced_stack, receiver):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    rid = f"traced-http-{secrets.token_hex(4)}"
    text = f"{secrets.token_hex(4)} " + " ".join(f"w{i}" for i in range(8))
    body = {"model": "", "messages": [{"role": "user", "content": text}], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"x-request-id": rid, "traceparent": f"00-{trace_id}-{client_span}-01"}
    with httpx.stream("POST", f"{traced_stack.http}/v1/chat/completions", json=body, headers=headers,
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"

    wanted = {"POST /v1/chat/completions", "render_chat", "tokenizer.RenderChat", "admission", "route", "stream",
              "tokenizer.DetokenizeStream", "shard.sequence", "prefill", "decode"}
    spans = receiver.trace(trace_id, lambda got: wanted <= {s.name for s in got})
    tree = render_tree(spans)
    assert {s.service for s in spans} == {"kimiserve-router", "kimiserve-tokenizer", "kimiserve-shard"}, tree
    assert all(s.attributes.get("kimiserve.request_id") == rid for s in spans), tree

    root = one(spans, "POST /v1/chat/completions")
    assert root.parent_id == client_span, tree  # the client's traceparent header
    assert root.attributes["http.request.method"] == "POST"
    assert root.attributes["http.route"] == "/v1/chat/completions"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["finish_reason"] == "length" and root.attributes["completion_tokens"] == 3
    assert root.error == ""
    for name in ("render_chat", "admission", "route", "stream"):
        assert_child(root, one(spans, name), spans)
    assert_child(one(spans, "render_chat"), one(spans, "tokenizer.RenderChat"), spans)
    assert_child(one(spans, "stream"), one(spans, "shard.sequence"), spans)
    assert_child(one(spans, "stream"), one(spans, "tokenizer.DetokenizeStream"), spans)
    assert_child(one(spans, "shard.sequence"), one(spans, "decode"), spans)


def test_a_refused_http_request_is_a_failed_span_named_by_its_route(traced_stack, receiver):
    rid = f"traced-http-bad-{secrets.token_hex(4)}"
    resp = httpx.post(f"{traced_stack.http}/v1/completions", json={"prompt": "x", "best_of": 3},
                      headers={"x-request-id": rid}, timeout=60)
    assert resp.status_code == 400, resp.text
    spans = receiver.wait(lambda got: len(got) >= 1, lambda s: s.attributes.get("kimiserve.request_id") == rid)
    root = one(spans, "POST /v1/completions")
    assert root.parent_id == "" and root.attributes["http.response.status_code"] == 400
    assert "best_of" in root.error and root.error.startswith("400 invalid_argument"), root.error
    assert len(spans) == 1, render_tree(spans)  # refused before any tokenizer or shard work
