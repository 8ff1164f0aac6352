"""No way around the router, and a local stack no web page can drive: `kimiserve up` as a user starts it (no API
keys), then its internal ports and its HTTP API probed as a caller on the same host, or a browser, would.

- the tokenizer and shard refuse every call without up's internal token (UNAUTHENTICATED), health stays open;
- the router works end to end with the token on (gRPC and HTTP);
- a Cancel on one shard Stream cannot stop a sequence another stream submitted;
- /health names no internal address;
- without API keys the HTTP API refuses foreign Host / Origin headers and non-JSON POST bodies;
- shard, tokenizer and up refuse to listen beyond loopback with nothing to authenticate callers.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import stat
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kimiserve.internal_auth import TOKEN_HEADER
from kimiserve.ports import free_port
from kimiserve.v1 import (common_pb2, router_pb2, router_pb2_grpc, shard_pb2, shard_pb2_grpc, tokenizer_pb2,
                          tokenizer_pb2_grpc)
from tests.services.helpers import generate

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "temperature": 0}


class Up:
    def __init__(self, proc: subprocess.Popen, addresses: dict[str, str], http: str, state):
        self.proc, self.addresses, self.http, self.state = proc, addresses, http, state

    @property
    def token(self) -> str:
        return (self.state / "internal-token").read_text().strip()


def _up(model, state, *args: str):
    """`kimiserve up` started as a user starts it; yields (Up, HTTP port) once it printed its addresses."""
    http_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--model", str(model), "--port",
                             str(free_port()), "--http-port", str(http_port), "--state-dir", str(state),
                             "--num-state-slots", "4", "--num-kv-blocks", "128", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    addresses: dict[str, str] = {}
    try:
        end = time.monotonic() + 240
        while "router" not in addresses or "shard-0" not in addresses:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "up exited before printing its addresses"
            assert time.monotonic() < end, "up did not print its addresses in time"
            if m := re.match(r"\s+(router|tokenizer|shard-\d+)\s+(\S+)\s+metrics", line):
                addresses[m.group(1)] = m.group(2)
        yield Up(proc, addresses, f"http://127.0.0.1:{http_port}", state)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(90)


@pytest.fixture(scope="module")
def up(tiny_linear, tmp_path_factory):
    yield from _up(tiny_linear, tmp_path_factory.mktemp("up-state") / "stack")


def _stream(channel: grpc.Channel, metadata=()):
    """A Shard/Stream: (request queue, event iterator). None on the queue ends the stream."""
    requests: queue.Queue = queue.Queue()

    def outgoing():
        while (r := requests.get()) is not None:
            yield r
    return requests, shard_pb2_grpc.ShardStub(channel).Stream(outgoing(), metadata=metadata, timeout=120)


def _submit(rid: str, max_tokens: int) -> shard_pb2.ShardRequest:
    return shard_pb2.ShardRequest(submit=shard_pb2.ShardRequest.Submit(
        request_id=rid, prompt_token_ids=[5, 6, 7, 8], max_tokens=max_tokens,
        sampling=common_pb2.SamplingParams(temperature=0, ignore_eos=True)))


def _cancel(rid: str) -> shard_pb2.ShardRequest:
    return shard_pb2.ShardRequest(cancel=shard_pb2.ShardRequest.Cancel(request_id=rid))


def _until_finished(events) -> tuple[int, shard_pb2.ShardEvent]:
    tokens = 0
    for event in events:
        assert event.WhichOneof("kind") != "error", event
        if event.WhichOneof("kind") == "token":
            tokens += 1
        else:
            return tokens, event
    raise AssertionError("the stream ended before the sequence finished")


def test_the_token_file_is_private(up):
    mode = (up.state / "internal-token").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600 and len(up.token) >= 32


@pytest.mark.parametrize("metadata", [(), ((TOKEN_HEADER, "x" * 43),)], ids=["anonymous", "wrong-token"])
def test_internal_ports_refuse_callers_without_the_token(up, metadata):
    with grpc.insecure_channel(up.addresses["shard-0"]) as channel:
        requests, events = _stream(channel, metadata)
        requests.put(_submit("intruder", 4))
        with pytest.raises(grpc.RpcError) as e:
            next(events)
        requests.put(None)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        shard = shard_pb2_grpc.ShardStub(channel)
        for call, req in ((shard.Info, shard_pb2.ShardInfoRequest()), (shard.Load, shard_pb2.ShardLoadRequest())):
            with pytest.raises(grpc.RpcError) as e:
                call(req, metadata=metadata, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Health stays open: probes and `up` cannot send the token.
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(up.addresses["tokenizer"]) as channel:
        with pytest.raises(grpc.RpcError) as e:
            tokenizer_pb2_grpc.TokenizerStub(channel).Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"),
                                                               metadata=metadata, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_router_serves_end_to_end_with_the_token_on(up):
    with grpc.insecure_channel(up.addresses["router"]) as channel:
        ids, _, last = generate(router_pb2_grpc.RouterStub(channel), text="Hello there", max_tokens=3,
                                temperature=0, ignore_eos=True)
    assert len(ids) == 3 and last.usage.completion_tokens == 3
    reply = httpx.post(up.http + "/v1/chat/completions", json=CHAT, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def test_a_cancel_reaches_only_the_stream_that_submitted(up):
    """Stream B cancels A's live request id: A's sequence runs to its full length; B's cancel of its own works."""
    auth = ((TOKEN_HEADER, up.token),)
    with grpc.insecure_channel(up.addresses["shard-0"]) as channel:
        a_requests, a_events = _stream(channel, auth)
        b_requests, b_events = _stream(channel, auth)
        a_requests.put(_submit("victim", 120))
        assert next(a_events).WhichOneof("kind") == "token"  # A's sequence is live
        b_requests.put(_cancel("victim"))
        b_requests.put(_submit("own", 120))  # after the cancel on B's stream: handled in order
        assert next(b_events).WhichOneof("kind") == "token"
        b_requests.put(_cancel("own"))
        _, b_end = _until_finished(b_events)
        assert b_end.request_id == "own" and b_end.finished.finish_reason == common_pb2.FINISH_REASON_CANCELLED
        tokens, a_end = _until_finished(a_events)
        assert a_end.request_id == "victim"
        assert a_end.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH, a_end
        assert tokens + 1 == a_end.finished.usage.completion_tokens == 120
        a_requests.put(None)
        b_requests.put(None)


def test_health_names_no_internal_address(up):
    reply = httpx.get(up.http + "/health", headers={"host": "anything.example"}, timeout=10)  # exempt from Host
    assert reply.status_code == 200 and reply.json() == {"status": "ok", "shards_in_rotation": 1}
    for address in up.addresses.values():
        assert address.rsplit(":", 1)[1] not in reply.text


@pytest.mark.parametrize("headers, status, code", [
    ({"host": "evil.example"}, 403, "host_not_allowed"),
    ({"host": "evil.example:8000"}, 403, "host_not_allowed"),
    ({"origin": "http://evil.example"}, 403, "origin_not_allowed"),
    ({"origin": "null"}, 403, "origin_not_allowed"),
    ({"content-type": "text/plain"}, 415, "unsupported_media_type"),
    ({"content-type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
])
def test_without_keys_requests_a_web_page_could_send_are_refused(up, headers, status, code):
    reply = httpx.post(up.http + "/v1/chat/completions", content=json.dumps(CHAT),
                       headers={"content-type": "application/json", **headers}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == code and error["type"] in ("permission_error", "invalid_request_error")


def test_without_keys_local_origins_and_hosts_are_served(up):
    for headers in ({"origin": "http://localhost:3000"}, {"host": "localhost"}, {"host": "[::1]:80"}):
        reply = httpx.post(up.http + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
        assert reply.status_code == 200, (headers, reply.text)


def _refusal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("service", ["shard", "tokenizer"])
def test_an_internal_service_beyond_loopback_without_auth_refuses_to_start(tiny_linear, service):
    out = _refusal(service, "--model", str(tiny_linear), "--host", "0.0.0.0", "--port", str(free_port()))
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{service}: refusing to listen on 0.0.0.0 with no caller authentication" in out.stderr
    assert "--allow-unauthenticated" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_router_without_the_token_is_refused_by_the_tokenizer_in_one_line(up):
    out = _refusal("router", "--tokenizer", up.addresses["tokenizer"], "--shards", up.addresses["shard-0"],
                   "--port", str(free_port()), "--metrics-port", str(free_port()))
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"the tokenizer at {up.addresses['tokenizer']} refuses the router" in out.stderr
    assert "--internal-token-file" in out.stderr and "Traceback" not in out.stderr


def test_up_beyond_loopback_without_keys_refuses_to_start(tiny_linear, tmp_path):
    out = _refusal("up", "--model", str(tiny_linear), "--host", "0.0.0.0", "--port", str(free_port()),
                   "--state-dir", str(tmp_path / "s"))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--host 0.0.0.0" in out.stderr and "--api-keys-file" in out.stderr


def test_up_passes_api_keys_and_tls_to_the_router(tiny_linear, tmp_path):
    """`up --api-keys-file --tls-cert --tls-key`: both public ports speak TLS and want a key; `up` still sees the
    router come up (through its plaintext health port)."""
    import ssl

    from tests.deploy.certs import write_secret_dirs

    key = "up-key-0123456789abcdef"
    secrets = write_secret_dirs(tmp_path / "etc", "kimiserve-internal", f"{key}\n")
    tls = secrets["router-tls"]
    stack = _up(tiny_linear, tmp_path / "state", "--api-keys-file", str(secrets["api-keys"]),
                "--tls-cert", str(tls / "tls.crt"), "--tls-key", str(tls / "tls.key"))
    up_tls = next(stack)
    try:
        creds = grpc.ssl_channel_credentials((tls / "ca.crt").read_bytes())
        with grpc.secure_channel(up_tls.addresses["router"], creds) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                generate(stub, text="Hi", max_tokens=2)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            chunks = list(stub.Generate(router_pb2.GenerateRequest(text="Hi", sampling=common_pb2.SamplingParams(
                max_tokens=2, temperature=0, ignore_eos=True)), metadata=(("authorization", f"Bearer {key}"),),
                timeout=60))
            assert chunks[-1].usage.completion_tokens == 2
        https = up_tls.http.replace("http://", "https://")
        verify = ssl.create_default_context(cafile=str(tls / "ca.crt"))
        assert httpx.post(https + "/v1/chat/completions", json=CHAT, verify=verify, timeout=60).status_code == 401
        reply = httpx.post(https + "/v1/chat/completions", json=CHAT, verify=verify, timeout=60,
                           headers={"authorization": f"Bearer {key}"})
        assert reply.status_code == 200, reply.text
        with pytest.raises(httpx.HTTPError) as plain:  # TLS only
            httpx.get(up_tls.http + "/health", timeout=10)
        # A refused connection (nothing listening) would raise too: the port must take it and drop plain HTTP.
        assert not isinstance(plain.value, httpx.ConnectError), f"plain HTTP was not refused by TLS: {plain.value!r}"
    finally:
        stack.close()
