"""The stack `make soak` loads (launcher/soak.py): `kimiserve up` as a child process, its services found by the lines
`up` prints, each service's process found again at every look (a restarted child has a new pid), its RSS, and the
slots and KV blocks the shards still hold (their own gauges)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

# `up`'s line per child: "  tokenizer  127.0.0.1:PORT  metrics http://127.0.0.1:PORT/metrics"
CHILD_LINE = re.compile(r"^\s+(?P<name>\S+)\s+(?P<host>[^\s:]+):(?P<port>\d+)\s+metrics (?P<metrics>\S+)\s*$")
HELD_GAUGES = ("kimiserve_shard_state_slots_used", "kimiserve_shard_kv_blocks_used")


class StackFailed(RuntimeError):
    """`kimiserve up` exited or did not print its services in time."""


@dataclass(frozen=True)
class Service:
    name: str  # tokenizer | shard-I | router
    port: int
    metrics_url: str


class Stack:
    """`kimiserve up` started with `args`; its stderr (every service's log) goes to `log_path`."""

    def __init__(self, args: list[str], log_path: Path, timeout_s: float) -> None:
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", *args], stdout=subprocess.PIPE,
                                     stderr=self._log)
        self.services = self._read_services(timeout_s, log_path)

    def _read_services(self, timeout_s: float, log_path: Path) -> list[Service]:
        """The children `up` lists once all are SERVING (the router's line comes last)."""
        found: list[Service] = []
        end = time.monotonic() + timeout_s
        while not any(s.name == "router" for s in found):
            line = self.proc.stdout.readline().decode()
            if not line:
                raise StackFailed(f"kimiserve up exited ({self.proc.wait()}) before it was up; its log: {log_path}")
            if time.monotonic() > end:
                raise StackFailed(f"kimiserve up was not up after {timeout_s:.0f} s; its log: {log_path}")
            if m := CHILD_LINE.match(line):
                found.append(Service(m["name"], int(m["port"]), m["metrics"]))
        return found

    def pid(self, service: Service) -> int | None:
        """The live process of `service` now: the child of `up` whose command line serves its port."""
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
                if int(fields["PPid"]) != self.proc.pid:
                    continue
                argv = (status.parent / "cmdline").read_bytes().split(b"\0")
            except (OSError, KeyError, ValueError):  # the process ended while we looked
                continue
            if b"--port" in argv and argv[argv.index(b"--port") + 1] == str(service.port).encode():
                return int(status.parent.name)
        return None

    def stop(self) -> int:
        """SIGTERM `up`, which drains and stops its children; its exit status."""
        self.proc.terminate()
        try:
            return self.proc.wait(120)
        finally:
            self._log.close()


def rss_and_threads(pid: int) -> tuple[float, int] | None:
    """VmRSS of `pid` in MiB and its thread count (each thread may hold a malloc arena); None once it is gone."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["Threads"])
    except (OSError, KeyError, ValueError):
        return None


def held(service: Service) -> dict[str, float]:
    """The shard's slot and KV-block gauges (sequences only: the prefix cache's blocks are counted apart)."""
    with urllib.request.urlopen(service.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    out = {name: 0.0 for name in HELD_GAUGES}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out
