"""Real stacks for the fault tests: `kimiserve up` as a subprocess, exactly as an operator runs it, supervising a
tokenizer, two shards and a router (tiny kimi_linear, fast on a CPU).

`up` logs every child it starts or restarts ("child started" / "child restarted", with name, pid, address and
metrics URL) as JSON lines on stderr; UpStack reads them from its log file to know the current pids and addresses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from launcher.health import is_serving
from tests.services.helpers import scrape, total, wait_until

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARD_GAUGES = ("kimiserve_shard_state_slots_used", "kimiserve_shard_kv_blocks_used")


@dataclass
class ChildInfo:
    name: str
    pid: int
    address: str
    metrics_url: str


class UpStack:
    """`kimiserve up --shards N` in a process of its own, with XDG_CACHE_HOME (hence the router's batch database)
    in `home`; its JSON log goes to `home/up.log`. Its ports are free ones (the HTTP API's too: two stacks of
    parallel test workers must not both ask for the default 8000)."""

    def __init__(self, model: Path, home: Path, shards: int = 2, extra_args: tuple[str, ...] = ()):
        self.home, self.log_path = home, home / "up.log"
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.router = f"127.0.0.1:{self.port}"
        env = {**os.environ, "XDG_CACHE_HOME": str(home / "cache"), "PYTHONPATH": str(REPO_ROOT)}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launcher.cli", "up", "--model", str(model), "--shards", str(shards),
                 "--port", str(self.port), "--http-port", str(free_port()), "--startup-timeout", "120",
                 *extra_args],
                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.channel = grpc.insecure_channel(self.router)
        self.stub = router_pb2_grpc.RouterStub(self.channel)

    @property
    def internal_token_file(self) -> Path:
        """Where `up` wrote this run's internal token: its default state directory (under XDG_CACHE_HOME)."""
        return self.home / "cache" / "kimiserve" / f"stack-127.0.0.1-{self.port}" / "internal-token"

    @property
    def internal_token(self) -> str:
        return self.internal_token_file.read_text().strip()

    # -- what `up` logged ----------------------------------------------------------------------------------------
    def events(self, msg: str | None = None, service: str = "up") -> list[dict]:
        text = self.log_path.read_bytes().decode(errors="replace")
        out = []
        for line in text[:text.rfind("\n") + 1].splitlines():  # a line still being written is not read yet
            if line.startswith("{"):
                entry = json.loads(line)
                if entry.get("service") == service and (msg is None or entry.get("msg") == msg):
                    out.append(entry)
        return out

    def children(self) -> dict[str, ChildInfo]:
        """name -> its current process (the last one `up` started)."""
        out: dict[str, ChildInfo] = {}
        for e in self.events("child started"):
            out[e["child"]] = ChildInfo(e["child"], e["pid"], e["address"], e["metrics_url"])
        for e in self.events("child restarted"):
            out[e["child"]] = ChildInfo(e["child"], e["pid"], e["address"], out[e["child"]].metrics_url)
        return out

    def child(self, name: str) -> ChildInfo:
        return self.children()[name]

    def all_pids(self) -> set[int]:
        """Every child process `up` ever started."""
        return {e["pid"] for e in self.events("child started") + self.events("child restarted")}

    def shards(self) -> list[ChildInfo]:
        return [c for n, c in sorted(self.children().items()) if n.startswith("shard-")]

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def wait_up(self, timeout: float = 150) -> "UpStack":
        """Until the router is SERVING with every shard in rotation (it serves once one shard is)."""
        end = time.monotonic() + timeout
        while not ("router" in self.children() and is_serving(self.router)
                   and all(self.rotation_events(s.address, "shard in rotation") for s in self.shards())):
            assert self.proc.poll() is None, f"`up` exited with {self.proc.returncode}:\n{self.tail()}"
            assert time.monotonic() < end, f"`up` not serving after {timeout} s:\n{self.tail()}"
            time.sleep(0.2)
        return self

    def signal(self, name: str, sig: signal.Signals) -> ChildInfo:
        child = self.child(name)
        os.kill(child.pid, sig)
        return child

    def wait_restarted(self, name: str, old_pid: int, timeout: float = 60) -> ChildInfo:
        """Waits until `up` has started `name` again and the new process is SERVING."""
        end = time.monotonic() + timeout
        while True:
            child = self.child(name)
            if child.pid != old_pid and is_serving(child.address):
                return child
            assert self.proc.poll() is None, f"`up` exited with {self.proc.returncode}:\n{self.tail()}"
            assert time.monotonic() < end, f"{name} not restarted and SERVING after {timeout} s:\n{self.tail()}"
            time.sleep(0.2)

    def rotation_events(self, address: str, msg: str) -> int:
        """How many times the router logged `msg` ("shard in rotation" / "shard left rotation") for a shard."""
        return sum(e.get("shard") == address for e in self.events(msg, service="router"))

    def wait_back_in_rotation(self, address: str, entries_before: int, timeout: float = 60) -> None:
        """Waits until the router has put the shard in rotation again since it had logged `entries_before`
        "shard in rotation" lines for it (its metrics gauge lags by up to one export period)."""
        wait_until(lambda: self.rotation_events(address, "shard in rotation") > entries_before, timeout,
                   f"the router to put {address} back in rotation")

    def assert_shards_idle(self, timeout: float = 30) -> None:
        """Every shard's slot and KV-block gauges back to zero (nothing leaked by the test)."""
        def idle() -> bool:
            for s in self.shards():
                series = scrape(s.metrics_url)
                if any(total(series, g) != 0 for g in SHARD_GAUGES):
                    return False
            return True

        try:
            wait_until(idle, timeout, "the shards' slot and KV-block gauges to return to 0")
        except AssertionError:
            leaked = {s.name: {g: total(scrape(s.metrics_url), g) for g in SHARD_GAUGES} for s in self.shards()}
            raise AssertionError(f"shard gauges not back to 0 after {timeout} s: {leaked}") from None

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM to `up`; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"`up` did not stop within {timeout} s after SIGTERM:\n{self.tail()}")
        return self.proc.returncode

    def close(self) -> None:
        self.channel.close()
        try:
            self.stop()
        finally:
            for pid in alive(self.all_pids()):  # never leave a child behind, even when a test failed
                os.kill(pid, signal.SIGKILL)


def alive(pids) -> set[int]:
    """The pids among `pids` that still run (zombies, dead but not yet reaped, count as gone)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            out.add(pid)
    return out


@pytest.fixture(scope="module")
def up_stack(tiny_linear, tmp_path_factory) -> UpStack:
    """One supervised 2-shard stack for a module's tests; each test must leave it serving with every shard idle."""
    stack = UpStack(tiny_linear, tmp_path_factory.mktemp("up_stack")).wait_up()
    yield stack
    stack.close()


@pytest.fixture
def make_up(tiny_linear, tmp_path):
    """Stacks of a test's own (tests that stop or break `up` itself)."""
    stacks: list[UpStack] = []

    def make(*extra_args: str, shards: int = 2, model: Path | None = None) -> UpStack:
        stack = UpStack(model or tiny_linear, tmp_path / f"up-{len(stacks)}", shards, extra_args)
        stacks.append(stack)
        return stack

    yield make
    for s in stacks:
        s.close()


# -- streaming many requests at once -------------------------------------------------------------------------------
@dataclass
class Outcome:
    index: int
    streamed: int  # token ids received
    completion_tokens: int | None  # usage in the last chunk; None when the stream failed
    code: grpc.StatusCode | None  # None: finished
    details: str = ""
    failed_after_s: float | None = None  # seconds from `since` (the fault) to the failure
    ended_at: float = 0.0  # time.monotonic() when the stream ended either way


def stream_many(stub, n: int, max_tokens: int, timeout: float = 150
                ) -> tuple[list[threading.Thread], dict[int, Outcome], list[float]]:
    """Starts `n` streaming Generate calls (greedy, ignore_eos) in threads. Returns the threads, the outcomes filled
    as they end, and an empty list the caller appends the fault's monotonic time to (failures are timed from it)."""
    outcomes: dict[int, Outcome] = {}
    fault_at: list[float] = []

    def one(i: int) -> None:
        req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                            ignore_eos=True))
        req.prompt_token_ids.ids.extend([(i % 50) + 3] * (3 + i % 5))
        streamed, last = 0, None
        try:
            for chunk in stub.Generate(req, timeout=timeout):
                streamed += len(chunk.token_ids)
                last = chunk
            outcomes[i] = Outcome(i, streamed, last.usage.completion_tokens, None, ended_at=time.monotonic())
        except grpc.RpcError as e:
            now = time.monotonic()
            after = now - fault_at[0] if fault_at else None
            outcomes[i] = Outcome(i, streamed, None, e.code(), e.details(), after, ended_at=now)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads, outcomes, fault_at
