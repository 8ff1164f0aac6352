"""Two router replicas in front of one shard, as the chart runs them (router.replicas: 2): each knows only its own
live request ids, so two clients of different replicas may pick the same id at once. The shard refuses the second
as already live there; the router must send it again under an alias, never hand the client a clash it cannot see
(nor tell it that some other client, perhaps another tenant, runs that id)."""

from __future__ import annotations

import shutil
import threading

import grpc
import pytest

from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from launcher.up import start_router_replica, start_stack, stop_stack
from tests.services.conftest import SHARD_ARGS

PROMPT = [5, 17, 42, 99, 3, 8]
# The 4-layer model steps in ~12 ms on the CPU: 400 tokens keep the first request running for seconds after the
# second is sent (the 93-layer K3 took ~0.4 s a step, 80 s for 200 tokens).
LONG_TOKENS = 400


@pytest.fixture
def two_routers(tiny_linear, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_linear, model)
    children = start_stack(model, 1, "cpu", "127.0.0.1", free_port(), timeout=180, shard_args=SHARD_ARGS)
    try:
        children.append(start_router_replica(children, "router-2", "127.0.0.1", free_port(), timeout=180))
        yield [router_pb2_grpc.RouterStub(grpc.insecure_channel(c.address)) for c in children if c.role == "router"]
    finally:
        stop_stack(children, grace_s=20)


def _request(request_id: str, max_tokens: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=common_pb2.TokenIds(ids=PROMPT),
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                         ignore_eos=True))


def _tokens(stream) -> list[int]:
    return [t for chunk in stream for t in chunk.token_ids]


def test_the_same_id_from_two_replicas_at_once_runs_on_both(two_routers):
    first, second = two_routers
    long_stream = first.Generate(_request("shared-id", LONG_TOKENS), timeout=120)
    started = threading.Event()
    long_tokens: list[int] = []

    def read_long() -> None:
        for chunk in long_stream:
            long_tokens.extend(chunk.token_ids)
            started.set()

    reader = threading.Thread(target=read_long)
    reader.start()
    assert started.wait(60), "the first replica's request produced no token"
    short = _tokens(second.Generate(_request("shared-id", 8), timeout=60))
    assert len(long_tokens) < LONG_TOKENS, "the first request ended before the second was sent: nothing was shared"
    reader.join(120)
    assert len(long_tokens) == LONG_TOKENS
    # Greedy: the aliased run is the same sequence as the first one's start, and as a fresh run of its own.
    assert short == long_tokens[:8] == _tokens(second.Generate(_request("after", 8), timeout=60))
