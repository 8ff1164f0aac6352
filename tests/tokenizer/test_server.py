"""The tokenizer service as a user runs it: `python -m tokenizer_svc` in a subprocess, answered over real gRPC."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.tokenizer.texts import MIXED_TEXT

REPO_ROOT = Path(__file__).resolve().parents[2]
GEN_PROMPT = "<|im_assistant|>assistant<|im_middle|>"


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    address: str
    channel: grpc.Channel
    stub: tokenizer_pb2_grpc.TokenizerStub
    metrics_port: int
    log_path: Path

    def log_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]


def start_server(model_dir: Path, log_path: Path) -> Running:
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "tokenizer_svc", "--model", str(model_dir), "--model-name", "tiny",
           "--port", str(port), "--metrics-port", str(metrics_port), "--max-message-chars", "1000"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"tokenizer service exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"tokenizer service not SERVING after 30 s:\n{log_path.read_text()}")
        time.sleep(0.1)
    stub = tokenizer_pb2_grpc.TokenizerStub(channel)
    return Running(proc, f"127.0.0.1:{port}", channel, stub, metrics_port, log_path)


def stop_server(server: Running) -> int:
    server.channel.close()
    server.proc.send_signal(signal.SIGTERM)
    return server.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    running = start_server(tiny_dir, tmp_path_factory.mktemp("tokenizer_server") / "server.log")
    yield running
    if running.proc.poll() is None:
        running.proc.kill()
        running.proc.wait()


def test_logs_one_serving_line_with_the_address(server: Running) -> None:
    serving = [line for line in server.log_lines() if line["msg"].startswith("tokenizer service serving")]
    assert len(serving) == 1
    assert serving[0]["service"] == "tokenizer" and serving[0]["address"].startswith("127.0.0.1:")


def test_tokenize_detokenize_round_trip(server: Running) -> None:
    ids = list(server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=MIXED_TEXT)).token_ids)
    assert 514 in ids  # "<|im_end|>" in the text became its special id
    text = server.stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=ids, keep_special_tokens=True)).text
    assert text == MIXED_TEXT
    skipped = server.stub.Detokenize(tokenizer_pb2.DetokenizeRequest(model="tiny", token_ids=[*ids, 900, 1023])).text
    assert skipped == MIXED_TEXT.replace("<|im_end|>", "")


def test_token_bytes_are_each_ids_own(server: Running) -> None:
    """A character of several UTF-8 bytes split over tokens: each id's bytes are its own (not U+FFFD), and they
    concatenate to the text; a special token's are its text; an id past the vocab has none."""
    text = "naïve €5 — ok"
    ids = list(server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text)).token_ids)
    got = list(server.stub.TokenBytes(tokenizer_pb2.TokenBytesRequest(token_ids=[*ids, 514, 1023])).token_bytes)
    assert b"".join(got[:len(ids)]) == text.encode("utf-8")
    assert got[len(ids):] == [b"<|im_end|>", b""]
    byte_ids = list(server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="\u20ac")).token_ids)
    lone = [b for b in server.stub.TokenBytes(tokenizer_pb2.TokenBytesRequest(token_ids=byte_ids)).token_bytes]
    assert len(lone) == 3 and lone == [b"\xe2", b"\x82", b"\xac"]  # the tiny tokenizer has no merge for it
    with pytest.raises(grpc.RpcError) as err:
        server.stub.TokenBytes(tokenizer_pb2.TokenBytesRequest(token_ids=[0] * 65_537))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "65536" in err.value.details()


def test_render_chat(server: Running) -> None:
    request = tokenizer_pb2.RenderChatRequest(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    reply = server.stub.RenderChat(request)
    expected = (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>" + GEN_PROMPT
    )
    assert reply.prompt == expected
    assert list(reply.token_ids) == list(server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=expected)).token_ids)
    turns = expected[:expected.index("<|im_user|>")], expected[:-len(GEN_PROMPT)]  # where each message ends
    assert list(reply.message_ends) == [len(server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=t)).token_ids)
                                        for t in turns]
    request.add_generation_prompt = False
    assert not server.stub.RenderChat(request).prompt.endswith(GEN_PROMPT)


def test_render_chat_continues_the_final_assistant_message(server: Running) -> None:
    """continue_final_message: the closed rendering up to the final turn's end-of-turn marker, which is left out;
    the ids are the whole prompt's encoding and no message end falls inside the open turn."""
    messages = [common_pb2.ChatMessage(role="user", content="Hi"),
                common_pb2.ChatMessage(role="assistant", content="Sure, here is")]
    closed = server.stub.RenderChat(tokenizer_pb2.RenderChatRequest(messages=messages, add_generation_prompt=False))
    assert closed.prompt.endswith("<|im_assistant|>assistant<|im_middle|>Sure, here is<|im_end|>")
    reply = server.stub.RenderChat(tokenizer_pb2.RenderChatRequest(messages=messages, continue_final_message=True))
    assert reply.prompt == closed.prompt.removesuffix("<|im_end|>")
    whole = server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=reply.prompt)).token_ids
    assert list(reply.token_ids) == list(whole)
    assert list(reply.message_ends) == list(closed.message_ends)  # the system and user turns
    assert reply == server.stub.RenderChat(tokenizer_pb2.RenderChatRequest(
        messages=messages, continue_final_message=True, add_generation_prompt=False))


def _samples(server: Running) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    lines = [line.rsplit(" ", 1) for line in body.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in lines}


def test_render_chat_takes_a_shared_system_prompt_from_its_cache_only_under_the_same_salt(server: Running) -> None:
    cached = 'kimiserve_tokenizer_chat_pieces_total{cached="true"}'
    encoded = 'kimiserve_tokenizer_chat_pieces_total{cached="false"}'

    def render(salt: str, user: str) -> tuple[tokenizer_pb2.RenderChatResponse, float, float]:
        before = _samples(server)
        reply = server.stub.RenderChat(tokenizer_pb2.RenderChatRequest(cache_salt=salt, messages=[
            common_pb2.ChatMessage(role="system", content="The shared rules, " * 20),
            common_pb2.ChatMessage(role="user", content=user)]))
        after = _samples(server)
        return reply, after.get(cached, 0) - before.get(cached, 0), after[encoded] - before.get(encoded, 0)

    first, hits, misses = render("tenant-a", "first question")
    assert (hits, misses) == (0, 3)  # the system turn, the user turn, the generation prompt
    again, hits, misses = render("tenant-a", "second question")
    assert (hits, misses) == (2, 1), "the system turn and the generation prompt come from the cache"
    other, hits, misses = render("tenant-b", "second question")
    assert (hits, misses) == (0, 3), "another salt finds nothing another one cached"
    for reply in (first, again, other):  # and every reply is the whole prompt's encoding
        whole = server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=reply.prompt)).token_ids
        assert list(reply.token_ids) == list(whole)


def test_info(server: Running) -> None:
    info = server.stub.Info(tokenizer_pb2.TokenizerInfoRequest())
    assert (info.model, info.model_type, info.vocab_size) == ("tiny", "kimi_k3", 768)
    assert list(info.eos_token_ids) == [513, 514] and info.bos_token_id == 512
    specials = {t.content: t.id for t in info.special_tokens}
    assert specials["<|im_end|>"] == 514 and specials["[PAD]"] == 767 and len(specials) == 256
    assert info.chat_template_source == "builtin:kimi" and len(info.chat_template_sha256) == 64
    assert info.tokenizer_source == "tokenizer.json"


def test_detokenize_stream(server: Running) -> None:
    ids = list(server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="Hi 你好 😀!")).token_ids)
    requests = [tokenizer_pb2.DetokenizeStreamRequest(token_ids=[i]) for i in ids]
    replies = list(server.stub.DetokenizeStream(iter(requests)))
    assert len(replies) == len(ids) + 1 and replies[-1].final and not any(r.final for r in replies[:-1])
    assert all("\ufffd" not in r.text for r in replies)
    assert "".join(r.text for r in replies) == "Hi 你好 😀!"


def test_many_streams_open_at_once(server: Running) -> None:
    """Open DetokenizeStreams hold no server thread: 64 at once all answer before any of them closes."""
    ids = list(server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="Hi 你好")).token_ids)

    async def run() -> list[str]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            calls = [stub.DetokenizeStream() for _ in range(64)]
            for call in calls:
                await call.write(tokenizer_pb2.DetokenizeStreamRequest(token_ids=ids))
            texts = [(await asyncio.wait_for(call.read(), 10)).text for call in calls]
            for call in calls:
                await call.done_writing()
                assert (await call.read()).final
            return texts

    assert asyncio.run(run()) == ["Hi 你好"] * 64


def test_health_and_reflection(server: Running) -> None:
    health = health_pb2_grpc.HealthStub(server.channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="kimiserve.v1.Tokenizer")).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    services = ProtoReflectionDescriptorDatabase(server.channel).get_services()
    assert "kimiserve.v1.Tokenizer" in services and "grpc.health.v1.Health" in services


@pytest.mark.parametrize(
    ("request_", "code", "match"),
    [
        (tokenizer_pb2.RenderChatRequest(messages=[common_pb2.ChatMessage(role="wizard", content="x")]),
         grpc.StatusCode.INVALID_ARGUMENT, "messages[0]: unknown role 'wizard'"),
        (tokenizer_pb2.RenderChatRequest(
            messages=[common_pb2.ChatMessage(role="user", content="x")],
            tools=[common_pb2.Tool(json='{"type": "function", ')]),
         grpc.StatusCode.INVALID_ARGUMENT, "tools[0]: malformed JSON"),
        (tokenizer_pb2.RenderChatRequest(messages=[
            common_pb2.ChatMessage(role="user", content="x"),
            common_pb2.ChatMessage(role="assistant", tool_calls=[common_pb2.ToolCall(name="f", arguments="{oops")])]),
         grpc.StatusCode.INVALID_ARGUMENT, "messages[1].tool_calls[0] (f): arguments are not JSON"),
        (tokenizer_pb2.RenderChatRequest(messages=[common_pb2.ChatMessage(role="user", content="x" * 1001)]),
         grpc.StatusCode.INVALID_ARGUMENT, "messages[0]: 1001 characters is over the limit of 1000"),
        (tokenizer_pb2.RenderChatRequest(model="other", messages=[common_pb2.ChatMessage(role="user", content="x")]),
         grpc.StatusCode.NOT_FOUND, "model 'other' is not served here"),
        (tokenizer_pb2.RenderChatRequest(messages=[common_pb2.ChatMessage(role="user", content="x")],
                                         continue_final_message=True),
         grpc.StatusCode.INVALID_ARGUMENT, "continue_final_message: the final message (messages[0]) has role 'user'"),
        (tokenizer_pb2.RenderChatRequest(messages=[common_pb2.ChatMessage(role="assistant", content="x")],
                                         continue_final_message=True, add_generation_prompt=True),
         grpc.StatusCode.INVALID_ARGUMENT,
         "add_generation_prompt: true cannot be combined with continue_final_message"),
    ],
    ids=["unknown-role", "malformed-tool-json", "bad-arguments", "oversized", "unknown-model", "continue-a-user-turn",
         "continue-with-generation-prompt"],
)
def test_bad_input_is_rejected_and_the_server_keeps_serving(
    server: Running, request_: tokenizer_pb2.RenderChatRequest, code: grpc.StatusCode, match: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        server.stub.RenderChat(request_)
    assert err.value.code() == code
    assert match in err.value.details()
    assert list(server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text="ok")).token_ids)


def test_metrics_scrape_counts_requests(server: Running) -> None:
    """Before/after deltas: the server is shared with earlier tests, which raised the same counters."""
    before = _samples(server)
    for text in ("count me", "and me"):
        server.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text))
    with pytest.raises(grpc.RpcError):
        server.stub.Info(tokenizer_pb2.TokenizerInfoRequest(model="other"))
    after = _samples(server)
    moved = {k: after[k] - before.get(k, 0.0) for k in (
        'kimiserve_tokenizer_requests_total{code="OK",rpc="Tokenize"}',
        'kimiserve_tokenizer_requests_total{code="NOT_FOUND",rpc="Info"}',
        'kimiserve_tokenizer_request_duration_seconds_count{rpc="Tokenize"}')}
    assert list(moved.values()) == [2, 1, 2], moved


def test_sigterm_stops_gracefully(tiktoken_dir: Path, tmp_path: Path) -> None:
    running = start_server(tiktoken_dir, tmp_path / "server.log")  # also serves from the tiktoken.model path
    info = running.stub.Info(tokenizer_pb2.TokenizerInfoRequest())
    assert info.tokenizer_source == "tiktoken.model" and info.vocab_size == 768
    assert stop_server(running) == 0
    messages = [line["msg"] for line in running.log_lines()]
    assert "stopping on signal SIGTERM" in messages and messages[-1] == "tokenizer service stopped"
