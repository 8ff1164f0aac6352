"""A real stack on localhost, started as a user starts it: tokenizer, shards and router as separate processes
(tiny_k3 and tiny_linear come from tests/conftest.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest

from kimiserve.ports import free_port
from kimiserve.v1 import router_pb2_grpc
from launcher.up import start_stack, stop_stack

# Small pools and context so capacity and context-length paths are reachable in tests.
SHARD_ARGS = ("--num-state-slots", "8", "--num-kv-blocks", "256", "--max-model-len", "512")


class Stack:
    def __init__(self, children):
        self.children = {c.name: c for c in children}
        self.router = self.children["router"].address
        self.channel = grpc.insecure_channel(self.router)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def shard(self, i: int):
        return self.children[f"shard-{i}"]

    def close(self) -> None:
        self.channel.close()
        stop_stack(list(self.children.values()), grace_s=20)


def _start(model: Path) -> Stack:
    return Stack(start_stack(model, 2, "cpu", "127.0.0.1", free_port(), timeout=180, shard_args=SHARD_ARGS,
                             router_args=("--max-in-flight", "64", "--max-queued", "64")))


@pytest.fixture(scope="session")
def stack(tiny_k3) -> Stack:
    s = _start(tiny_k3)
    yield s
    s.close()


@pytest.fixture
def private_stack(tiny_linear, tmp_path) -> Stack:
    """A stack of its own, for tests that kill processes: on the 4-layer kimi_linear, whose CPU step (~12 ms) lets
    streams outlast the kill by seconds at a few hundred tokens, where the 93-layer K3's (~0.4 s) took a minute."""
    model = tmp_path / "model"
    shutil.copytree(tiny_linear, model)
    s = _start(model)
    yield s
    s.close()
