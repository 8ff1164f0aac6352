"""The tokenizer service does its CPU work on a fixed number of threads, however many calls arrive at once.

Issue 33: under a soak the tokenizer's RSS kept rising while its Python heap stayed flat. asyncio's default pool
started a new thread whenever every one was busy (up to min(32, cores + 4)), one more each time load peaked, and each
thread that encodes keeps a malloc arena of its own. The count of threads is what must stay bounded, and it is exact:
no timing or RSS threshold here.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
from pathlib import Path

import grpc
import pytest

from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.config import TokenizerServerConfig
from tokenizer_svc.main import add_args
from tokenizer_svc.server import load_served, start_server, work_pool

BURST = 24  # calls in flight at once: far more than any default pool's threads on a small machine


def _long_text(rng: random.Random, vocabulary: list[str]) -> str:
    # Long enough that encodes overlap: a pool that grows on demand starts a thread for each busy one.
    return " ".join(rng.choices(vocabulary, k=4_000))


async def _burst(cfg: TokenizerServerConfig) -> set[threading.Thread]:
    """Serve `cfg`, send BURST Tokenize and RenderChat calls at once, and return the threads started meanwhile."""
    before = set(threading.enumerate())
    rng = random.Random(0)
    vocabulary = ["".join(rng.choices("abcdefghij", k=rng.randint(2, 9))) for _ in range(5_000)]
    with work_pool(cfg) as work:
        server, _, port = await start_server(cfg, load_served(cfg), work)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = tokenizer_pb2_grpc.TokenizerStub(channel)
                calls = [stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=_long_text(rng, vocabulary))) if i % 2 else
                         stub.RenderChat(tokenizer_pb2.RenderChatRequest(messages=[
                             common_pb2.ChatMessage(role="user", content=_long_text(rng, vocabulary))]))
                         for i in range(BURST)]
                replies = await asyncio.gather(*calls)
            assert all(len(r.token_ids) > 1000 for r in replies)
            return set(threading.enumerate()) - before
        finally:
            await server.stop(None)


@pytest.mark.parametrize("work_threads", [1, 2])
def test_a_burst_of_calls_runs_on_the_configured_threads_only(tiny_dir: Path, work_threads: int) -> None:
    cfg = TokenizerServerConfig(model_dir=tiny_dir, port=free_port(), work_threads=work_threads)
    started = asyncio.run(_burst(cfg))
    names = sorted(t.name for t in started)
    # grpc.aio's own poller thread aside, every thread the burst started is one of the pool's, and all of them ran.
    work = [n for n in names if "_poll_wrapper" not in n]
    assert work == [f"tokenizer-work_{i}" for i in range(work_threads)], names


def test_work_threads_flag_refuses_zero() -> None:
    p = argparse.ArgumentParser()
    add_args(p)
    assert p.parse_args(["--model", ".", "--work-threads", "3"]).work_threads == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--model", ".", "--work-threads", "0"])
