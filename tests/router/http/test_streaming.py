"""SSE as curl sees it, and a client that goes away: its sequence is aborted on the shard, the slot freed at once."""

from __future__ import annotations

import json
import socket
import subprocess

import httpx

from tests.ci_tools import debian_tool
from tests.router.http.conftest import API_KEY
from tests.services.helpers import scrape, total, wait_until

LONG = {"model": "", "prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_curl_sse(http_stack):
    curl = debian_tool("curl", "curl")
    body = {"model": "", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True,
            "ignore_eos": True,  # the API's default temperature 1.0 could draw EOS before the fifth token
            "stream_options": {"include_usage": True}}
    out = subprocess.run([curl, "-N", "-sS", "--fail-with-body", f"{http_stack.base}/v1/chat/completions",
                          "-H", f"Authorization: Bearer {API_KEY}", "-H", "Content-Type: application/json",
                          "-d", json.dumps(body)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    events = [e for e in out.stdout.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def cancelled(http_stack) -> float:
    return sum(v for k, v in scrape(http_stack.shard_metrics).items()
               if k.startswith("kimiserve_shard_sequences_finished_total{") and 'reason="cancelled"' in k)


def slots_used(http_stack) -> float:
    return total(scrape(http_stack.shard_metrics), "kimiserve_shard_state_slots_used")


def test_disconnect_mid_stream_frees_the_slot(http_stack):
    before = cancelled(http_stack)
    with httpx.stream("POST", http_stack.base + "/v1/completions", json={**LONG, "stream": True}, timeout=60,
                      headers={"authorization": f"Bearer {API_KEY}"}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        wait_until(lambda: slots_used(http_stack) == 1, what="the sequence to hold its slot")
    # Closed after one chunk of 400: the shard cancels the sequence instead of generating the rest.
    wait_until(lambda: cancelled(http_stack) == before + 1 and slots_used(http_stack) == 0, timeout=10,
               what="the shard to cancel the abandoned sequence and free its slot")


def test_disconnect_while_waiting_for_a_whole_reply_frees_the_slot(http_stack):
    before = cancelled(http_stack)
    body = json.dumps(LONG).encode()
    port = int(http_stack.base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # a client that will just go away
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: slots_used(http_stack) == 1, what="the sequence to hold its slot")
    wait_until(lambda: cancelled(http_stack) == before + 1 and slots_used(http_stack) == 0, timeout=10,
               what="the shard to cancel the abandoned sequence and free its slot")
