"""The HTTP API's per-request latency on a fresh connection and on a kept-alive one.

Clients (the `openai` SDK, httpx, browsers) keep connections alive, so the kept-alive figure is what they see after
their first request. It must not be worse than a fresh connection's: a response written in two sends without
TCP_NODELAY waits for the client's delayed ACK (~40 ms on Linux) on a kept-alive connection only
(router/http/protocol.py). For each path, --requests requests one after another through httpx, once with a new
connection per request and once over one kept-alive connection (after one warm-up request each); prints and writes
the median and p90 of each in milliseconds.

    python -m bench.http_latency --url http://127.0.0.1:8000 [--api-key KEY] [--requests 50] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

def chat_body(model: str) -> dict:
    """A one-token chat completion: the model's work on top of the routing that GET /v1/models measures alone."""
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}


def latencies(url: str, n: int, keep_alive: bool, headers: dict[str, str] = {}, json_body: dict | None = None
              ) -> list[float]:
    """Seconds per request for `n` requests to `url` (GET, or POST of `json_body`), over one kept-alive connection
    or a new connection each time; one warm-up request first, not counted. Any non-200 answer raises."""
    limits = httpx.Limits() if keep_alive else httpx.Limits(max_keepalive_connections=0)
    out = []
    with httpx.Client(limits=limits, headers=headers, timeout=60) as client:
        for i in range(n + 1):
            start = time.perf_counter()
            reply = client.post(url, json=json_body) if json_body is not None else client.get(url)
            elapsed = time.perf_counter() - start
            if reply.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.text[:300]}")
            if i:
                out.append(elapsed)
    return out


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": round(statistics.median(ordered) * 1e3, 3),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 3), "requests": len(ordered)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    headers = {"authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    model = httpx.get(f"{a.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    result = {}
    for name, path, body in (("models", "/v1/models", None), ("chat_1_token", "/v1/chat/completions",
                                                               chat_body(model))):
        result[name] = {mode: summary(latencies(a.url + path, a.requests, mode == "keep_alive", headers, body))
                        for mode in ("fresh", "keep_alive")}
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
