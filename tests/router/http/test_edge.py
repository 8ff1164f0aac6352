"""The HTTP server's edge, met as a client meets it: a chunked upload over the body limit, connections that never
finish their request head, and the latency of a kept-alive connection against a fresh one."""

from __future__ import annotations

import socket
import statistics
import time
import uuid

import httpx

from bench.http_latency import latencies
from tests.router.http.conftest import API_KEY, HEAD_TIMEOUT_S, MAX_BODY

AUTH = {"authorization": f"Bearer {API_KEY}"}


LINE = (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
        b'[{"role": "user", "content": "Hi"}], "max_tokens": 1}}\n')


def _multipart(content: bytes) -> tuple[str, list[bytes]]:
    boundary = uuid.uuid4().hex
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n").encode()
    return f"multipart/form-data; boundary={boundary}", [head, content, f"\r\n--{boundary}--\r\n".encode()]


def test_a_chunked_upload_over_the_limit_is_413(http_stack):
    content_type, parts = _multipart(LINE * (MAX_BODY // len(LINE) + 1))
    reply = httpx.post(http_stack.base + "/v1/files", content=iter(parts),  # an iterator: chunked, no length
                       headers={**AUTH, "content-type": content_type}, timeout=60)
    assert reply.status_code == 413, reply.text
    assert reply.json()["error"]["code"] == "request_too_large"
    content_type, parts = _multipart(LINE)  # the same upload, chunked, under the limit
    reply = httpx.post(http_stack.base + "/v1/files", content=iter(parts),
                       headers={**AUTH, "content-type": content_type}, timeout=60)
    assert reply.status_code == 200 and reply.json()["bytes"] == len(LINE), reply.text


def _closed_after(sock: socket.socket, trickle: bytes, limit_s: float) -> float:
    """Sends `trickle` a byte every 0.2 s (never a whole request head); returns the seconds until the server closed
    the connection (recv returns EOF or the send fails), or fails after `limit_s`."""
    start = time.monotonic()
    sock.settimeout(0.2)
    for i in range(int(limit_s / 0.2)):
        try:
            sock.send(trickle[i % len(trickle):i % len(trickle) + 1])
            if sock.recv(1024) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    raise AssertionError(f"the server kept a connection without a complete request head open for {limit_s} s")


def test_connections_without_a_complete_request_head_are_dropped(http_stack):
    port = int(http_stack.base.rsplit(":", 1)[1])
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        slow[0].send(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        took = _closed_after(slow[0], b"X-Slow: 1\r\n", limit_s=HEAD_TIMEOUT_S + 8)
        assert HEAD_TIMEOUT_S - 0.5 <= took <= HEAD_TIMEOUT_S + 4, took
        for s in slow[1:]:  # the silent ones went at the same deadline
            s.settimeout(5)
            assert s.recv(1024) == b""
        # A kept-alive connection's next request gets the same deadline once its first byte arrives.
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            s.settimeout(10)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            s.send(b"GET /health HTTP/1.1\r\n")
            took = _closed_after(s, b"X-Slow: 1\r\n", limit_s=HEAD_TIMEOUT_S + 8)
            assert took <= HEAD_TIMEOUT_S + 4, took
        assert httpx.get(http_stack.base + "/health", timeout=10).status_code == 200  # the server serves on
    finally:
        for s in slow:
            s.close()


def test_a_kept_alive_connection_is_as_fast_as_a_fresh_one(http_stack):
    """Medians of 20 requests each; a response that waits for the client's delayed ACK (~40 ms) fails this by far."""
    url = http_stack.base + "/v1/models"
    fresh = statistics.median(latencies(url, 20, keep_alive=False, headers=AUTH))
    kept = statistics.median(latencies(url, 20, keep_alive=True, headers=AUTH))
    assert kept <= 2 * fresh + 0.005, f"kept-alive median {kept * 1e3:.1f} ms, fresh {fresh * 1e3:.1f} ms"
