"""One stack for the HTTP API tests: tokenizer, one shard and a router serving --http-port, started as a user starts
it, with API keys on (every client here sends the key; test_errors_auth checks the refusals).

It serves the 4-layer tiny Kimi-Linear: these tests are about the API, and a token of it costs a twentieth of the
93-layer tiny K3's (the folder took 98 s with the K3 and 32 s with it, on three workers); tests/services serve the
K3 end to end."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from openai import OpenAI

from kimiserve.ports import free_port
from kimiserve.v1 import router_pb2_grpc
from launcher.up import start_stack, stop_stack

API_KEY = "test-key-0123456789"
MAX_BODY = 1 << 20
HEAD_TIMEOUT_S = 2.0  # the router's --http-header-timeout (test_edge.py waits for it)
MAX_MODEL_LEN = 512
SHARD_ARGS = ("--num-state-slots", "8", "--num-kv-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN))


class HttpStack:
    def __init__(self, children, http_port: int, model: Path):
        self.children = {c.name: c for c in children}
        self.model_dir, self.model = model, model.name  # the served name: the checkpoint directory's
        self.base = f"http://127.0.0.1:{http_port}"
        self.client = OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        self.channel = grpc.insecure_channel(self.children["router"].address)
        self.grpc = router_pb2_grpc.RouterStub(self.channel)
        self.auth = (("authorization", f"Bearer {API_KEY}"),)  # gRPC metadata

    @property
    def shard_metrics(self) -> str:
        return self.children["shard-0"].metrics_url

    def close(self) -> None:
        self.channel.close()
        stop_stack(list(self.children.values()), grace_s=20)


@pytest.fixture(scope="session")
def http_stack(tiny_linear, tmp_path_factory) -> HttpStack:
    state = tmp_path_factory.mktemp("http-state")
    keys = state / "keys.txt"
    keys.write_text(API_KEY + "\n")
    http_port = free_port()
    children = start_stack(tiny_linear, 1, "cpu", "127.0.0.1", free_port(), timeout=180, shard_args=SHARD_ARGS,
                           router_args=("--http-port", str(http_port), "--http-max-body-bytes", str(MAX_BODY),
                                        "--api-keys-file", str(keys), "--batch-db", str(state / "b.sqlite3"),
                                        "--http-header-timeout", str(HEAD_TIMEOUT_S)))
    s = HttpStack(children, http_port, tiny_linear)
    yield s
    s.close()
