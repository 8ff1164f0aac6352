"""Real processes on localhost: one tokenizer and two shards (tiny kimi_linear) for the whole folder, and routers
started per test as `kimiserve router` with their own batch database and a captured JSON log."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from kimiserve.ports import free_port
from kimiserve.v1 import router_pb2, router_pb2_grpc
from launcher.health import wait_serving

REPO_ROOT = Path(__file__).resolve().parents[3]
# 16 state slots per shard; a 256-token context so an over-long prompt is easy to write.
SHARD_ARGS = ("--num-state-slots", "16", "--num-kv-blocks", "512", "--max-model-len", "256")
TERMINAL = {router_pb2.BATCH_STATUS_COMPLETED, router_pb2.BATCH_STATUS_FAILED, router_pb2.BATCH_STATUS_EXPIRED,
            router_pb2.BATCH_STATUS_CANCELLED}


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    with log_path.open("ab") as log:
        return subprocess.Popen([sys.executable, "-m", "launcher.cli", *args], cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen, grace_s: float = 20) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Backends:
    tokenizer: str
    shards: list[str]
    shard_metrics: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)


@pytest.fixture(scope="session")
def backends(tiny_linear, tmp_path_factory) -> Backends:
    logs = tmp_path_factory.mktemp("batch_backend_logs")
    tok_port = free_port()
    b = Backends(f"127.0.0.1:{tok_port}", [], [])
    b.procs.append(_spawn(["tokenizer", "--model", str(tiny_linear), "--port", str(tok_port)], logs / "tok.log"))
    for i in range(2):
        port, metrics_port = free_port(), free_port()
        b.shards.append(f"127.0.0.1:{port}")
        b.shard_metrics.append(f"http://127.0.0.1:{metrics_port}/metrics")
        b.procs.append(_spawn(["shard", "--model", str(tiny_linear), "--shard-name", f"shard-{i}", "--port",
                               str(port), "--metrics-port", str(metrics_port), *SHARD_ARGS], logs / f"shard{i}.log"))
    try:
        for address, proc in zip([b.tokenizer, *b.shards], b.procs):
            wait_serving(address, 120, alive=lambda p=proc: p.poll() is None)
    except BaseException:
        for proc in b.procs:
            _stop(proc)
        raise
    yield b
    for proc in b.procs:
        _stop(proc)


class RouterProc:
    """`kimiserve router` with its own --batch-db; start / SIGKILL / restart on the same port and database."""

    def __init__(self, backends: Backends, db: Path, log_path: Path, args: tuple[str, ...] = (),
                 log_level: str = "INFO"):
        self.backends, self.db, self.log_path, self.args, self.log_level = backends, db, log_path, args, log_level
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.proc: subprocess.Popen | None = None
        self.channel = grpc.insecure_channel(self.address)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    def start(self) -> "RouterProc":
        self.log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.proc = _spawn(["--log-level", self.log_level, "router", "--tokenizer", self.backends.tokenizer,
                            "--shards", ",".join(self.backends.shards), "--port", str(self.port), "--metrics-port",
                            str(self.metrics_port), "--batch-db", str(self.db), *self.args], self.log_path)
        wait_serving(self.address, 60, alive=lambda: self.proc.poll() is None)
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        _stop(self.proc)
        return self.proc.returncode

    def logs(self, this_run_only: bool = False) -> list[dict]:
        data = self.log_path.read_bytes()[self.log_start if this_run_only else 0:].decode(errors="replace")
        return [json.loads(line) for line in data.splitlines() if line.startswith("{")]

    # -- batch helpers --------------------------------------------------------------------------------------
    def create(self, jsonl: str | None = None, inline=None, **kw) -> router_pb2.Batch:
        req = router_pb2.CreateBatchRequest(**kw)
        if jsonl is not None:
            req.jsonl = jsonl
        else:
            req.inline.requests.extend(inline)
        return self.stub.CreateBatch(req, timeout=30)

    def get(self, batch_id: str) -> router_pb2.Batch:
        return self.stub.GetBatch(router_pb2.GetBatchRequest(batch_id=batch_id), timeout=30)

    def wait(self, batch_id: str, statuses=TERMINAL, timeout: float = 120, until=None) -> router_pb2.Batch:
        end = time.monotonic() + timeout
        while True:
            batch = self.get(batch_id)
            if (until(batch) if until else batch.status in statuses):
                return batch
            if time.monotonic() > end:
                raise AssertionError(f"batch {batch_id} still {router_pb2.BatchStatus.Name(batch.status)} after "
                                     f"{timeout} s: {batch}")
            time.sleep(0.05)

    def results(self, batch_id: str, after_seq: int = 0, follow: bool = False) -> list[router_pb2.BatchResult]:
        req = router_pb2.GetBatchResultsRequest(batch_id=batch_id, after_seq=after_seq, follow=follow)
        return list(self.stub.GetBatchResults(req, timeout=120))

    def close(self) -> None:
        self.channel.close()
        if self.proc is not None:
            _stop(self.proc)


@pytest.fixture
def make_router(backends, tmp_path):
    routers: list[RouterProc] = []

    def make(*args: str, log_level: str = "INFO", db: Path | None = None) -> RouterProc:
        r = RouterProc(backends, db or tmp_path / f"batches-{len(routers)}.sqlite3",
                       tmp_path / f"router-{len(routers)}.log", args, log_level)
        routers.append(r)
        return r.start()

    yield make
    for r in routers:
        r.close()


@pytest.fixture(scope="module")
def router(backends, tmp_path_factory) -> RouterProc:
    """One router shared by the tests of a module that do not restart it."""
    tmp = tmp_path_factory.mktemp("batch_router")
    r = RouterProc(backends, tmp / "batches.sqlite3", tmp / "router.log").start()
    yield r
    r.close()
