"""A catalogue of bad inputs against a real stack (tokenizer, two shards, router as separate processes).

Every input gets its exact gRPC status and a message naming what was wrong, and a normal request succeeds right
after it. Requests go out as raw bytes on generic calls, so well-formed messages and corrupt bodies take the same
path. At the end, both shards' slot and KV-block gauges are back to zero: no bad input leaked capacity.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import safetensors.torch
import torch

from kimiserve import limits
from kimiserve.ports import free_port, free_ports
from kimiserve.v1 import (common_pb2, router_pb2, router_pb2_grpc, shard_pb2, shard_pb2_grpc, tokenizer_pb2,
                          tokenizer_pb2_grpc)
from launcher.health import wait_serving
from launcher.up import start_stack, stop_stack

OK, INVALID, NOT_FOUND = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
UNAUTHENTICATED, TOO_LARGE = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED
SERVICES = {"router": router_pb2.DESCRIPTOR.services_by_name["Router"],
            "tokenizer": tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"],
            "shard": shard_pb2.DESCRIPTOR.services_by_name["Shard"]}
# Small pools and context, so the context-length paths are reachable.
SHARD_ARGS = ("--num-state-slots", "8", "--num-kv-blocks", "256", "--max-model-len", "512")
VOCAB = 1024  # the tiny model vocabulary
GOOD_KEY = "catalogue-key-1"


@dataclass
class Stack:
    children: dict
    channels: dict[str, grpc.Channel]
    keyed: str  # a second router, sharing the tokenizer and shards, that requires API keys from `keys_file`
    keys_file: Path

    def serves(self) -> None:
        """A normal small request succeeds, with exact usage."""
        stub = router_pb2_grpc.RouterStub(self.channels["router"])
        ids, last = [], None
        for last in stub.Generate(gen(max_tokens=2, temperature=0.0, ignore_eos=True), timeout=60):
            ids.extend(last.token_ids)
        assert len(ids) == 2 and last.usage.completion_tokens == 2 and last.usage.prompt_tokens == 3


@pytest.fixture(scope="module")
def stack(tiny_linear, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-inputs")
    children = start_stack(tiny_linear, 2, "cpu", "127.0.0.1", free_port(), timeout=180, shard_args=SHARD_ARGS,
                           router_args=("--batch-db", str(tmp / "batches.sqlite")))
    by_name = {c.name: c for c in children}
    keys_file = tmp / "api-keys"
    keys_file.write_text(f"# the catalogue's key\n{GOOD_KEY}\n")
    port, metrics_port = free_ports(2, "127.0.0.1")
    keyed = subprocess.Popen([sys.executable, "-m", "launcher.cli", "router", "--tokenizer",
                              by_name["tokenizer"].address, "--shards",
                              ",".join(c.address for c in children if c.name.startswith("shard-")),
                              "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
                              "--api-keys-file", str(keys_file), "--batch-db", str(tmp / "keyed.sqlite")],
                             start_new_session=True)
    channels = {name: grpc.insecure_channel(by_name[child].address, options=[("grpc.max_send_message_length", -1)])
                for name, child in (("router", "router"), ("tokenizer", "tokenizer"), ("shard-0", "shard-0"),
                                    ("shard-1", "shard-1"))}
    try:
        wait_serving(f"127.0.0.1:{port}", 120, alive=lambda: keyed.poll() is None)
        yield Stack(by_name, channels, f"127.0.0.1:{port}", keys_file)
    finally:
        keyed.terminate()
        keyed.wait(30)
        for channel in channels.values():
            channel.close()
        stop_stack(children, grace_s=20)


# ---- request builders --------------------------------------------------------------------------------------------

def gen(ids=(1, 2, 3), text=None, request_id=None, model="", **sampling) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(model=model, sampling=common_pb2.SamplingParams(**sampling))
    if text is not None:
        req.text = text
    elif ids is not None:
        req.prompt_token_ids.CopyFrom(common_pb2.TokenIds(ids=ids))
    if request_id is not None:
        req.request_id = request_id
    return req


def chat(*messages, tools=(), model="", **sampling) -> router_pb2.ChatRequest:
    return router_pb2.ChatRequest(model=model, messages=list(messages), tools=list(tools),
                                  sampling=common_pb2.SamplingParams(**{"max_tokens": 2, **sampling}))


def user(content="hi") -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role="user", content=content)


def calling(arguments: str, name="f") -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(role="assistant", tool_calls=[common_pb2.ToolCall(name=name, arguments=arguments)])


def fn_tool(name="f", parameters_json="") -> common_pb2.Tool:
    return common_pb2.Tool(function=common_pb2.FunctionTool(name=name, parameters_json=parameters_json))


def deep(levels: int) -> str:
    """Well-formed JSON object nesting `levels` deep."""
    return '{"a":' + "[" * (levels - 1) + "]" * (levels - 1) + "}"


def submit(request_id: str, ids=(1, 2, 3), max_tokens=2, boundaries=(), prior_output=0) -> shard_pb2.ShardRequest:
    return shard_pb2.ShardRequest(submit=shard_pb2.ShardRequest.Submit(
        request_id=request_id, prompt_token_ids=list(ids), max_tokens=max_tokens, message_boundaries=boundaries,
        prior_output_tokens=prior_output))


def state(*chunks, model_type="kimi_linear", tokens=(1, 2, 3), total_bytes=None) -> list:
    """An ImportState transfer: a header (total_bytes: the data's length unless given), then the data chunks."""
    data = [shard_pb2.SequenceStateChunk(data=c) for c in chunks]
    header = shard_pb2.SequenceStateHeader(request_id="imported-1", tokens=list(tokens), model_type=model_type,
                                           total_bytes=sum(map(len, chunks)) if total_bytes is None else total_bytes)
    return [shard_pb2.SequenceStateChunk(header=header), *data]


# A sequence state of the right tensors at the wrong shapes (one number each).
WRONG_SHAPES = safetensors.torch.save({name: torch.zeros(1) for name in ("recurrent", "conv", "kv")})

# A serialized GenerateRequest cut in the middle of its text field, and one whose text is not UTF-8.
TRUNCATED = gen(text="hello world").SerializeToString()[:8]
BAD_UTF8_TEXT = b"\x12\x04a\xff\xfeb"
CORRUPT = b"\xff\xff\xff\xff"
BATCH_ID = "batch_" + "0" * 32

# (id, target, rpc, request (a message, bytes, or a list of them for a request stream), status, key phrase)
CASES = [
    # -- Generate: the prompt --
    ("generate-empty-text", "router", "Generate", gen(text=""), INVALID, "empty prompt"),
    ("generate-empty-ids", "router", "Generate", gen(ids=[]), INVALID, "prompt"),
    ("generate-no-prompt", "router", "Generate", router_pb2.GenerateRequest(), INVALID, "set either text or"),
    ("generate-longer-than-context", "router", "Generate", gen(ids=[5] * 600, max_tokens=2), INVALID, "context"),
    ("generate-id-past-vocab", "router", "Generate", gen(ids=[5, VOCAB]), INVALID, f"vocab size {VOCAB}"),
    ("generate-text-over-limit", "router", "Generate", gen(text="x" * (limits.MAX_PROMPT_BYTES + 1)), INVALID,
     f"text: {limits.MAX_PROMPT_BYTES + 1:,} bytes is over the limit of {limits.MAX_PROMPT_BYTES:,}"),
    ("generate-multibyte-text-over-limit", "router", "Generate", gen(text="é" * (limits.MAX_PROMPT_BYTES // 2 + 1)),
     INVALID, f"text: {limits.MAX_PROMPT_BYTES + 2:,} bytes is over the limit"),
    ("generate-ids-over-limit", "router", "Generate", gen(ids=[5] * (limits.MAX_PROMPT_TOKEN_IDS + 1)), INVALID,
     f"prompt_token_ids: {limits.MAX_PROMPT_TOKEN_IDS + 1:,} ids is over the limit"),
    ("generate-unknown-model", "router", "Generate", gen(model="no-such-model"), NOT_FOUND, "no-such-model"),
    ("generate-cache-salt-too-long", "router", "Generate", router_pb2.GenerateRequest(
        prompt_token_ids=common_pb2.TokenIds(ids=[1, 2, 3]), cache_salt="s" * 257), INVALID,
     "cache_salt has 257 characters; at most 256"),
    # -- Generate: sampling --
    ("max-tokens-zero", "router", "Generate", gen(max_tokens=0), INVALID, "max_tokens must be >= 1, got 0"),
    ("max-tokens-negative", "router", "Generate", gen(max_tokens=-3), INVALID, "max_tokens must be >= 1, got -3"),
    ("temperature-negative", "router", "Generate", gen(temperature=-1), INVALID, "temperature"),
    ("temperature-nan", "router", "Generate", gen(temperature=float("nan")), INVALID, "temperature"),
    ("temperature-inf", "router", "Generate", gen(temperature=float("inf")), INVALID, "temperature"),
    ("temperature-above-100", "router", "Generate", gen(temperature=100.5), INVALID, "temperature"),
    ("top-p-above-one", "router", "Generate", gen(top_p=1.5), INVALID, "top_p"),
    ("top-p-zero", "router", "Generate", gen(top_p=0.0), INVALID, "top_p"),
    ("top-p-nan", "router", "Generate", gen(top_p=float("nan")), INVALID, "top_p"),
    ("top-k-negative", "router", "Generate", gen(top_k=-1), INVALID, "top_k"),
    ("too-many-stop-strings", "router", "Generate", gen(stop=["s"] * 17), INVALID,
     "sampling.stop: 17 stop strings is over the limit of 16"),
    ("stop-string-too-long", "router", "Generate", gen(stop=["ok", "x" * 1025]), INVALID,
     "sampling.stop[1]: 1,025 bytes is over the limit of 1,024"),
    ("too-many-stop-token-ids", "router", "Generate", gen(stop_token_ids=[5] * 257), INVALID,
     "sampling.stop_token_ids: 257 ids is over the limit of 256"),
    ("stop-token-id-past-vocab", "router", "Generate", gen(stop_token_ids=[VOCAB + 7]), INVALID, str(VOCAB + 7)),
    # -- request ids --
    ("request-id-control-char", "router", "Generate", gen(request_id="a\nb"), INVALID, "request id"),
    ("request-id-non-ascii", "router", "Generate", gen(request_id="réquest"), INVALID, "printable ASCII"),
    ("request-id-too-long", "router", "Generate", gen(request_id="r" * 257), INVALID, "at most 256"),
    ("request-id-batch-form", "router", "Generate", gen(request_id=f"{BATCH_ID}:line-1:0"), INVALID, "reserved"),
    # -- Chat: messages --
    ("chat-no-messages", "router", "Chat", chat(), INVALID, "messages is empty"),
    ("chat-unknown-role", "router", "Chat", chat(common_pb2.ChatMessage(role="wizard", content="hi")), INVALID,
     "unknown role 'wizard'"),
    ("chat-oversized-message", "router", "Chat", chat(user("x" * 1_200_000)), INVALID, "messages[0]: 1200000"),
    ("chat-200k-messages", "router", "Chat", chat(*[user("x")] * 200_000), INVALID,
     "messages: 200,000 messages is over the limit of 4,096"),
    ("chat-messages-over-bytes", "router", "Chat", chat(*[user("x" * 900_000)] * 4), INVALID,
     f"bytes is over the limit of {limits.MAX_CHAT_BYTES:,}"),
    ("chat-tool-message-without-id", "router", "Chat", chat(user(), common_pb2.ChatMessage(role="tool", content="r")),
     INVALID, "messages[1]: a tool message needs the tool_call_id"),
    ("chat-user-with-tool-calls", "router", "Chat",
     chat(common_pb2.ChatMessage(role="user", tool_calls=[common_pb2.ToolCall(name="f", arguments="{}")])), INVALID,
     "role 'user' cannot carry tool_calls"),
    ("chat-tool-call-without-name", "router", "Chat", chat(user(), calling("{}", name="")), INVALID,
     "messages[1].tool_calls[0]: function name is empty"),
    ("chat-tool-call-args-not-json", "router", "Chat", chat(user(), calling("{oops")), INVALID,
     "messages[1].tool_calls[0] (f): arguments are not JSON"),
    ("chat-tool-call-args-not-object", "router", "Chat", chat(user(), calling("[1]")), INVALID,
     "arguments must be a JSON object"),
    ("chat-tool-call-args-recursion-deep", "router", "Chat", chat(user(), calling('{"a":' + "[" * 100_000)),
     INVALID, "messages[1].tool_calls[0] (f): arguments: JSON nests deeper than the limit of 64"),
    ("chat-tool-call-args-one-past-depth", "router", "Chat", chat(user(), calling(deep(65))), INVALID,
     "deeper than the limit of 64"),
    ("chat-stop-strings-over-limit", "router", "Chat", chat(user(), stop=["s"] * 17), INVALID, "sampling.stop"),
    ("chat-temperature-nan", "router", "Chat", chat(user(), temperature=float("nan")), INVALID, "temperature"),
    ("chat-unknown-model", "router", "Chat", chat(user(), model="no-such-model"), NOT_FOUND, "no-such-model"),
    # -- Chat: tools --
    ("tools-malformed-json", "router", "Chat", chat(user(), tools=[common_pb2.Tool(json="{not json")]), INVALID,
     "tools[0]: malformed JSON"),
    ("tools-json-not-object", "router", "Chat", chat(user(), tools=[common_pb2.Tool(json="[1, 2]")]), INVALID,
     "tools[0]: must be a JSON object"),
    ("tools-json-too-deep", "router", "Chat", chat(user(), tools=[common_pb2.Tool(json="[" * 100_000)]), INVALID,
     "tools[0]: JSON nests deeper than the limit of 64"),
    ("tools-parameters-too-deep", "router", "Chat", chat(user(), tools=[fn_tool(parameters_json='{"a":' * 50_000)]),
     INVALID, "tools[0] (f): parameters_json: JSON nests deeper"),
    ("tools-parameters-not-object", "router", "Chat", chat(user(), tools=[fn_tool(parameters_json="[1]")]),
     INVALID, "parameters_json must be a JSON object"),
    ("tools-function-without-name", "router", "Chat", chat(user(), tools=[fn_tool(name="")]), INVALID,
     "tools[0]: function name is empty"),
    ("tools-neither-definition", "router", "Chat", chat(user(), tools=[common_pb2.Tool()]), INVALID,
     "tools[0]: neither `function` nor `json` is set"),
    ("tools-over-count", "router", "Chat", chat(user(), tools=[fn_tool()] * 129), INVALID,
     "tools: 129 tools is over the limit of 128"),
    ("tools-over-bytes", "router", "Chat",
     chat(user(), tools=[common_pb2.Tool(json=json.dumps({"description": "d" * 600_000}))]), INVALID,
     f"bytes is over the limit of {limits.MAX_TOOLS_BYTES:,}"),
    # -- corrupt and oversized bodies --
    ("raw-generate-corrupt", "router", "Generate", CORRUPT, INVALID, "not a valid protobuf message"),
    ("raw-generate-truncated", "router", "Generate", TRUNCATED, INVALID, "not a valid protobuf message"),
    ("raw-generate-text-not-utf8", "router", "Generate", BAD_UTF8_TEXT, INVALID, "bad UTF-8"),
    ("raw-chat-corrupt", "router", "Chat", CORRUPT, INVALID, "kimiserve.v1.ChatRequest"),
    ("raw-list-models-corrupt", "router", "ListModels", b"\x0a\xff", INVALID, "kimiserve.v1.ListModelsRequest"),
    ("raw-create-batch-corrupt", "router", "CreateBatch", CORRUPT, INVALID, "kimiserve.v1.CreateBatchRequest"),
    ("raw-get-batch-results-corrupt", "router", "GetBatchResults", CORRUPT, INVALID, "not a valid protobuf"),
    ("request-over-transport-limit", "router", "Generate", gen(text="x" * (limits.MAX_REQUEST_BYTES + 1)),
     TOO_LARGE, "larger than max"),
    # -- batch RPCs --
    ("batch-no-input", "router", "CreateBatch", router_pb2.CreateBatchRequest(), INVALID, "set inline or jsonl"),
    ("batch-window-too-long", "router", "CreateBatch",
     router_pb2.CreateBatchRequest(jsonl="{}", completion_window_s=8 * 86_400), INVALID, "completion_window_s"),
    ("batch-concurrency-over-limit", "router", "CreateBatch",
     router_pb2.CreateBatchRequest(jsonl="{}", max_concurrency=1_000_000), INVALID, "max_concurrency 1000000"),
    ("batch-metadata-over-limit", "router", "CreateBatch",
     router_pb2.CreateBatchRequest(jsonl="{}", metadata={f"k{i}": "v" for i in range(17)}), INVALID, "17 pairs"),
    ("batch-get-unknown", "router", "GetBatch", router_pb2.GetBatchRequest(batch_id=BATCH_ID), NOT_FOUND, BATCH_ID),
    ("batch-cancel-unknown", "router", "CancelBatch", router_pb2.CancelBatchRequest(batch_id="nope"), NOT_FOUND,
     "nope"),
    ("batch-results-unknown", "router", "GetBatchResults", router_pb2.GetBatchResultsRequest(batch_id="nope"),
     NOT_FOUND, "nope"),
    ("batch-list-page-size", "router", "ListBatches", router_pb2.ListBatchesRequest(page_size=101), INVALID,
     "page_size must be in 1..100"),
    ("batch-list-page-token", "router", "ListBatches", router_pb2.ListBatchesRequest(page_token="zz"), INVALID,
     "page_token 'zz'"),
    # -- the tokenizer service directly --
    ("tokenizer-corrupt", "tokenizer", "Tokenize", CORRUPT, INVALID, "kimiserve.v1.TokenizeRequest"),
    ("tokenizer-unknown-model", "tokenizer", "Tokenize", tokenizer_pb2.TokenizeRequest(model="nope", text="hi"),
     NOT_FOUND, "'nope'"),
    ("tokenizer-render-200k-messages", "tokenizer", "RenderChat",
     tokenizer_pb2.RenderChatRequest(messages=[user("x")] * 200_000), INVALID, "messages: 200,000 messages"),
    ("tokenizer-render-deep-args", "tokenizer", "RenderChat",
     tokenizer_pb2.RenderChatRequest(messages=[user(), calling('{"a":' + "[" * 5000)]), INVALID, "deeper"),
    ("tokenizer-detokenize-stream-corrupt", "tokenizer", "DetokenizeStream",
     [tokenizer_pb2.DetokenizeStreamRequest(token_ids=[100]), CORRUPT], INVALID, "DetokenizeStreamRequest"),
    # -- a shard directly --
    ("shard-info-corrupt", "shard", "Info", b"\x0a\xff", INVALID, "kimiserve.v1.ShardInfoRequest"),
    ("shard-load-corrupt", "shard", "Load", CORRUPT, INVALID, "kimiserve.v1.ShardLoadRequest"),
    ("shard-stream-corrupt", "shard", "Stream", [CORRUPT], INVALID, "kimiserve.v1.ShardRequest"),
    # -- moving sequence states between shards (docs/failover.md) --
    ("shard-export-never-moved", "shard", "ExportState", shard_pb2.ExportStateRequest(request_id="never-moved"),
     NOT_FOUND, "no moved state is held for request 'never-moved'"),
    ("shard-import-corrupt", "shard", "ImportState", [CORRUPT], INVALID, "kimiserve.v1.SequenceStateChunk"),
    ("shard-import-no-header", "shard", "ImportState", state(b"xyz")[1:], INVALID, "must begin with its header"),
    ("shard-import-other-model", "shard", "ImportState", state(b"xyz", model_type="kimi_k3"), INVALID,
     "made by a 'kimi_k3' model; this shard serves 'kimi_linear'"),
    ("shard-import-short", "shard", "ImportState", state(b"xyz", total_bytes=10), INVALID,
     "announced 10 bytes and sent 3"),
    ("shard-import-not-safetensors", "shard", "ImportState", state(b"\0" * 16), INVALID, "not a safetensors file"),
    ("shard-import-wrong-shapes", "shard", "ImportState", state(WRONG_SHAPES), INVALID,
     "its recurrent is (1,) torch.float32; this shard holds ("),
]


def call(stack: Stack, target: str, rpc: str, request, channel: grpc.Channel | None = None, metadata=None):
    """One call as raw bytes on a generic method of the right streaming kind; returns the response bytes."""
    service = SERVICES[target]
    method = service.methods_by_name[rpc]
    path = f"/{service.full_name}/{rpc}"
    channel = channel or stack.channels["shard-0" if target == "shard" else target]
    encode = lambda r: r if isinstance(r, bytes) else r.SerializeToString()  # noqa: E731
    if method.client_streaming:
        rpc_call = (channel.stream_stream if method.server_streaming else channel.stream_unary)(path)
        result = rpc_call(iter([encode(r) for r in request]), timeout=120, metadata=metadata)
    else:
        rpc_call = (channel.unary_stream if method.server_streaming else channel.unary_unary)(path)
        result = rpc_call(encode(request), timeout=120, metadata=metadata)
    return list(result) if method.server_streaming else result


def status_of(stack: Stack, target: str, rpc: str, request, **kw) -> tuple[grpc.StatusCode, str]:
    try:
        call(stack, target, rpc, request, **kw)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return OK, ""


@pytest.mark.parametrize("target, rpc, request_, code, phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_its_status_and_the_stack_keeps_serving(stack, target, rpc, request_, code, phrase):
    got, details = status_of(stack, target, rpc, request_)
    assert (got, phrase in details) == (code, True), details[:500]
    assert len(details) < limits.MAX_ERROR_CHARS + 300, "a status message must stay short"
    stack.serves()


def then_a_good_one(stack: Stack, request_: shard_pb2.ShardRequest, good_id: str) -> list[shard_pb2.ShardEvent]:
    """`request_` and then a good one-token submit `good_id` on one shard stream, held open until the good one has
    finished (closing it cancels what is live); the events up to that finish."""
    finished = threading.Event()

    def requests():
        yield request_
        yield submit(good_id, max_tokens=1)
        finished.wait(60)

    stream = shard_pb2_grpc.ShardStub(stack.channels["shard-0"]).Stream(requests(), timeout=60)
    events = []
    for event in stream:
        events.append(event)
        if event.WhichOneof("kind") == "finished":
            finished.set()
            break
    stream.cancel()
    return events


@pytest.mark.parametrize("request_", [
    shard_pb2.ShardRequest(),
    submit("cat-empty", ids=[]),
    submit("cat-past-vocab", ids=[5, VOCAB + 1]),
    submit("cat-no-budget", max_tokens=0),
    submit("cat-boundary-past-prompt", boundaries=[1, 3]),
    submit("cat-boundaries-not-increasing", ids=range(1, 9), boundaries=[4, 2]),
    submit("cat-all-prior-output", ids=[1, 2, 3], prior_output=3),
], ids=["neither-submit-nor-cancel", "empty-prompt", "id-past-vocab", "max-tokens-zero", "boundary-past-prompt",
        "boundaries-not-increasing", "all-prior-output"])
def test_shard_refuses_a_bad_submit_with_an_invalid_argument_event(stack, request_):
    """The shard answers on its stream (ShardEvent.Error), not with a status, and the stream stays usable: a good
    submit after the bad one finishes. The request stream stays open until then (closing it cancels what is live)."""
    events = then_a_good_one(stack, request_, "cat-after")
    errors = [e.error.code for e in events if e.WhichOneof("kind") == "error"]
    assert errors == [shard_pb2.SHARD_ERROR_CODE_INVALID_ARGUMENT], events
    assert events[-1].request_id == "cat-after" and events[-1].finished.usage.completion_tokens == 1, events
    stack.serves()


def test_a_submit_for_an_imported_state_never_imported_is_unavailable_naming_the_field(stack):
    """The router answers this by failing the sequence over with a recompute; the shard serves on."""
    sub = submit("never-imported", ids=(1, 2, 3, 4))
    sub.submit.imported_state = True
    events = then_a_good_one(stack, sub, "after-it")
    error = events[0].error
    assert (events[0].request_id, error.code, error.param) == (
        "never-imported", shard_pb2.SHARD_ERROR_CODE_UNAVAILABLE, "imported_state"), events
    assert "none is held under its id" in error.message
    assert events[-1].request_id == "after-it" and events[-1].finished.usage.completion_tokens == 1, events
    stack.serves()


def test_a_deeply_nested_tool_result_is_text_and_renders(stack):
    """A tool result is text, never parsed: deep JSON there is no error (and no RecursionError)."""
    result = common_pb2.ChatMessage(role="tool", tool_call_id="functions.f:0", content="[" * 100 + "]" * 100)
    assert status_of(stack, "router", "Chat", chat(user(), calling("{}"), result, max_tokens=1)) == (OK, "")
    stack.serves()


# ---- API keys: a second router that requires them ------------------------------------------------------------------

def _keyed_status(stack: Stack, key: str | None) -> tuple[grpc.StatusCode, str]:
    metadata = [("authorization", f"Bearer {key}")] if key is not None else None
    with grpc.insecure_channel(stack.keyed) as channel:
        return status_of(stack, "router", "ListModels", router_pb2.ListModelsRequest(), channel=channel,
                         metadata=metadata)


def _wait_keyed(stack: Stack, key: str, code: grpc.StatusCode, what: str) -> str:
    """Polls until the keyed router answers `key` with `code` (it re-reads its key file every 2 s)."""
    deadline = time.monotonic() + 30
    while (got := _keyed_status(stack, key))[0] != code:
        assert time.monotonic() < deadline, f"{what}: still {got}"
        time.sleep(0.2)
    return got[1]


@pytest.mark.parametrize("key, phrase", [(None, "missing API key"), ("", "malformed API key"),
                                         ("not-a-key", "wrong API key")], ids=["missing", "empty", "wrong"])
def test_api_key_refusals(stack, key, phrase):
    code, details = _keyed_status(stack, key)
    assert code == UNAUTHENTICATED and phrase in details
    assert _keyed_status(stack, GOOD_KEY)[0] == OK
    stack.serves()


@pytest.mark.parametrize("content", [b"\xff\xfe" + GOOD_KEY.encode() + b"\n", b"# all keys revoked\n", b""],
                         ids=["not-utf8", "only-a-comment", "empty"])
def test_a_broken_or_emptied_key_file_refuses_every_key_then_recovers(stack, content):
    """Was UNKNOWN for every request (invalid UTF-8) or kept the old keys (emptied file). Now no key is valid until
    the file holds keys again."""
    good = stack.keys_file.read_bytes()
    try:
        stack.keys_file.write_bytes(content)
        details = _wait_keyed(stack, GOOD_KEY, UNAUTHENTICATED, "the old key stays valid")
        assert "not accepted" in details
    finally:
        stack.keys_file.write_bytes(good)
    _wait_keyed(stack, GOOD_KEY, OK, "the restored key is refused")
    stack.serves()


# ---- clients: argv and files that are not UTF-8 ----------------------------------------------------------------

def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, timeout=120)


def test_a_prompt_of_non_utf8_argv_bytes_is_encoded_as_tiktoken_does(stack):
    """argv bytes that are not UTF-8 reach Python as lone surrogates: the prompt is sent with U+FFFD in their place
    (what Kimi's tiktoken tokenizer does) instead of the client crashing."""
    out = _cli("complete", "--prompt", b"a\xffb", "--max-tokens", "2", "--ignore-eos", "--json",
               "--router", stack.children["router"].address)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    result = json.loads(out.stdout.decode().strip().splitlines()[-1])
    expected = tokenizer_pb2_grpc.TokenizerStub(stack.channels["tokenizer"]).Tokenize(
        tokenizer_pb2.TokenizeRequest(text="a\ufffdb"), timeout=30).token_ids
    assert result["usage"] == {"prompt_tokens": len(expected), "completion_tokens": 2}
    stack.serves()


def test_batch_submit_of_a_file_that_is_not_utf8_is_a_clear_error(stack, tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_bytes(b'{"custom_id": "a\xff"}\n')
    out = _cli("batch", "submit", str(path), "--router", stack.children["router"].address)
    assert out.returncode == 2 and b"is not UTF-8 (byte offset 16)" in out.stderr, out.stderr[-2000:]
    missing = _cli("batch", "submit", str(tmp_path / "absent.jsonl"), "--router", stack.children["router"].address)
    assert missing.returncode == 2 and b"cannot read" in missing.stderr, missing.stderr[-2000:]
    stack.serves()


# ---- batches whose lines are bad -----------------------------------------------------------------------------------

def _batch_line(custom_id: str, body: dict, url="/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _finish_batch(stack: Stack, jsonl: str) -> tuple[router_pb2.Batch, dict[str, router_pb2.BatchResult]]:
    stub = router_pb2_grpc.RouterStub(stack.channels["router"])
    batch = stub.CreateBatch(router_pb2.CreateBatchRequest(jsonl=jsonl), timeout=30)
    results = {r.custom_id: r for r in stub.GetBatchResults(
        router_pb2.GetBatchResultsRequest(batch_id=batch.id, follow=True), timeout=120)}
    return stub.GetBatch(router_pb2.GetBatchRequest(batch_id=batch.id), timeout=30), results


def test_a_batch_line_nested_too_deep_fails_the_batch_by_name(stack):
    """Was a RecursionError in the parser, failing the batch as `internal`."""
    deep_line = '{"custom_id": "d", "body": ' + "[" * 5000 + "]" * 5000 + "}"
    batch, results = _finish_batch(stack, _batch_line("ok", {"prompt": "hi", "max_tokens": 2}) + "\n" + deep_line)
    assert batch.status == router_pb2.BATCH_STATUS_FAILED and not results
    assert [(e.code, e.line) for e in batch.errors] == [("invalid_json", 2)]
    assert "deeper than the limit of 64" in batch.errors[0].message
    stack.serves()


def test_bad_batch_lines_fail_alone_and_the_rest_complete(stack):
    chat_url = "/v1/chat/completions"
    lines = [
        _batch_line("good", {"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True}),
        _batch_line("surrogate", {"prompt": "a\udcffb", "max_tokens": 1}),
        _batch_line("many-messages", {"messages": [{"role": "user", "content": "x"}] * 5000}, chat_url),
        _batch_line("deep-args", {"messages": [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": '{"a":' + "[" * 3000}}]}]}, chat_url),
        _batch_line("nan-temperature", {"prompt": "hi", "temperature": float("nan")}),
        _batch_line("stop-too-long", {"prompt": "hi", "stop": ["x" * 2000]}),
    ]
    batch, results = _finish_batch(stack, "\n".join(lines))
    assert batch.status == router_pb2.BATCH_STATUS_COMPLETED, batch
    outcome = {cid: (r.error.code, r.error.message) if r.WhichOneof("outcome") == "error"
               else ("ok", r.response.usage.completion_tokens) for cid, r in results.items()}
    assert outcome["good"] == ("ok", 2) and outcome["surrogate"] == ("ok", 1)
    assert outcome["many-messages"][0] == "invalid_argument" and "5,000 messages" in outcome["many-messages"][1]
    assert outcome["deep-args"][0] == "invalid_argument" and "deeper than" in outcome["deep-args"][1]
    assert outcome["nan-temperature"][0] == "invalid_argument" and "temperature" in outcome["nan-temperature"][1]
    assert outcome["stop-too-long"][0] == "invalid_argument" and "sampling.stop[0]" in outcome["stop-too-long"][1]
    stack.serves()


# ---- last: nothing leaked ----------------------------------------------------------------------------------------

def _gauge(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


def test_zz_every_shard_gauge_is_back_to_zero(stack):
    """After the whole catalogue (this test runs last in the module), no slot or KV block is still held."""
    shards = [c for name, c in stack.children.items() if name.startswith("shard-")]
    names = ("kimiserve_shard_state_slots_used", "kimiserve_shard_kv_blocks_used")
    deadline = time.monotonic() + 30
    while (held := {(c.name, n): _gauge(c.metrics_url, n) for c in shards for n in names}) and any(held.values()):
        assert time.monotonic() < deadline, f"capacity still held: {held}"
        time.sleep(0.2)
    assert len(held) == 4
