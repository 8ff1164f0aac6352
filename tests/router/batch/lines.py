"""Building OpenAI batch lines, and the single requests a batch result must equal."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import grpc

from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def line(custom_id: str, url: str = COMPLETIONS, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def slow_lines(n: int, max_tokens: int = 24, prefix: str = "s") -> str:
    """Requests that always run max_tokens steps (ignore_eos), to keep a batch busy."""
    return "\n".join(line(f"{prefix}-{i}", prompt=f"slow request {i}", max_tokens=max_tokens, temperature=0,
                          ignore_eos=True) for i in range(n))


def mixed_spec(i: int) -> tuple[str, dict]:
    """Request i of the big batch: greedy and seeded completions, text and token-id prompts, and chats."""
    max_tokens = 1 if i % 50 == 7 else 3 + i % 4
    kind = i % 4
    if kind == 0:
        return COMPLETIONS, {"prompt": f"Request number {i} says", "max_tokens": max_tokens, "temperature": 0}
    if kind == 1:
        return COMPLETIONS, {"prompt": f"Seeded {i}:", "max_tokens": max_tokens, "temperature": 0.9, "top_p": 0.95,
                             "seed": 1000 + i}
    if kind == 2:
        return CHAT, {"messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": max_tokens,
                      "temperature": 0.8, "seed": i}
    return COMPLETIONS, {"prompt": [10 + i % 50, 20, 30, 40 + i % 7], "max_tokens": max_tokens, "temperature": 1.0,
                         "top_k": 20, "seed": i}


def single_request(url: str, body: dict):
    """The same request for Router.Generate / Router.Chat, built independently of router/batch/parse.py."""
    s = common_pb2.SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"])
    for key in ("top_p", "top_k", "seed"):
        if key in body:
            setattr(s, key, body[key])
    if url == CHAT:
        return router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(**m) for m in body["messages"]], sampling=s)
    req = router_pb2.GenerateRequest(sampling=s)
    if isinstance(body["prompt"], str):
        req.text = body["prompt"]
    else:
        req.prompt_token_ids.ids.extend(body["prompt"])
    return req


async def _run_one(stub, req) -> router_pb2.BatchResponse:
    call = stub.Chat(req) if isinstance(req, router_pb2.ChatRequest) else stub.Generate(req)
    out, text = router_pb2.BatchResponse(), []
    async for chunk in call:
        out.token_ids.extend(chunk.token_ids)
        text.append(chunk.text)
        out.reasoning_text += getattr(chunk, "reasoning_text", "")
        out.tool_calls.extend(getattr(chunk, "tool_calls", []))
        if chunk.finish_reason:
            out.finish_reason = chunk.finish_reason
            out.usage.CopyFrom(chunk.usage)
    out.text = "".join(text)
    return out


def run_singles(address: str, requests: list, concurrency: int = 32) -> list[router_pb2.BatchResponse]:
    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            sem = asyncio.Semaphore(concurrency)

            async def one(req):
                async with sem:
                    return await _run_one(stub, req)

            return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def assert_each_once(results: list[router_pb2.BatchResult], custom_ids: list[str]) -> None:
    counts = Counter(r.custom_id for r in results)
    assert sorted(counts) == sorted(custom_ids), "results do not cover exactly the batch's custom_ids"
    assert max(counts.values()) == 1, f"duplicated results: {[c for c, n in counts.items() if n > 1]}"
    assert [r.seq for r in results] == list(range(1, len(results) + 1))
