"""`make soak`: `kimiserve up` (the trained default model on the CPU unless told otherwise) under mixed traffic for
SOAK_MINUTES (60), sampling every service's RSS, then a report of memory over time, errors and leaks at idle.

Traffic (launcher/soak_traffic.py): Poisson arrivals at SOAK_RATE (2) requests/s of short chats with and without a
shared system message, n=2, logprobs, long prompts, streams the client cuts early, client timeouts and bad requests,
through the official OpenAI SDK (HTTP) and the gRPC stubs. Every SOAK_SAMPLE_S (5) s: VmRSS of the tokenizer, each
shard and the router (/proc/<pid>/status; a restarted child is found again by its port).

The report (a table on stdout, JSON in SOAK_OUT, soak-report.json): per service its RSS at the start (after a
warm-up), at half time, at the end of the load and after SOAK_IDLE_S (30) s idle, and its growth over each half of
the load; the issue-33 bar is a second-half growth under 5 % for every service. Then requests by kind and outcome,
the unexpected ones (an outcome its kind does not allow: a good request that failed, a bad one not refused with 400 /
INVALID_ARGUMENT), and what the shards still hold at idle. Exit 1 when a service misses the bar, anything was
unexpected, a shard still holds a slot or block, or a service restarted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai

from kimiserve.logs import setup_logging
from kimiserve.ports import free_ports
from kimiserve.v1 import router_pb2_grpc
from launcher.soak_stack import HELD_GAUGES, Service, Stack, held, rss_and_threads
from launcher.soak_traffic import MIX, Clients, pick

log = logging.getLogger("soak")
GROWTH_BAR = 0.05  # issue 33: over the second half of the load no service's RSS grows by 5 % or more
STARTUP_TIMEOUT_S = 600.0


class Samples:
    """RSS samples per service, (seconds since the load started, MiB), taken by a thread until stopped; also the
    pids each service had (more than one: it was restarted)."""

    def __init__(self, stack: Stack, every_s: float, started: float) -> None:
        self.stack, self.every_s, self.started = stack, every_s, started
        self.series: dict[str, list[tuple[float, float]]] = {s.name: [] for s in stack.services}
        self.pids: dict[str, set[int]] = {s.name: set() for s in stack.services}
        self.threads: dict[str, int] = {s.name: 0 for s in stack.services}  # the most seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def take(self) -> None:
        for service in self.stack.services:
            pid = self.stack.pid(service)
            seen = rss_and_threads(pid) if pid is not None else None
            if seen is not None:
                self.pids[service.name].add(pid)
                self.series[service.name].append((time.monotonic() - self.started, seen[0]))
                self.threads[service.name] = max(self.threads[service.name], seen[1])

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.take()

    def at(self, name: str, t: float, window_s: float) -> float:
        """The median RSS of `name` within window_s of t (one sample is noise: a request's buffers come and go)."""
        near = [mib for at, mib in self.series[name] if abs(at - t) <= window_s]
        if not near:
            raise RuntimeError(f"no RSS sample of {name} within {window_s:.0f} s of t={t:.0f} s "
                               f"({len(self.series[name])} samples in all)")
        return statistics.median(near)


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter[tuple[str, str]] = Counter()

    def record(self, kind: str, outcome: str) -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1

    def unexpected(self) -> dict[str, int]:
        return {f"{k} {o}": n for (k, o), n in sorted(self.outcomes.items()) if o not in MIX[k][2]}


def _one(clients: Clients, seed: int, kinds: tuple[str, ...], tally: Tally) -> None:
    rng = random.Random(seed)
    kind = pick(rng, kinds)
    try:
        outcome = MIX[kind][0](clients, rng)
    except Exception as e:  # noqa: BLE001 - a client-side failure is counted as unexpected, not allowed to end the soak
        log.warning("client-side failure", extra={"kind": kind, "error": f"{type(e).__name__}: {e}"})
        outcome = f"CLIENT {type(e).__name__}"
    tally.record(kind, outcome)


def drive(clients: Clients, rate: float, seconds: float, seed: int, max_in_flight: int, kinds: tuple[str, ...],
          tally: Tally, stop: threading.Event) -> int:
    """Poisson arrivals at `rate` for `seconds` (or until `stop`), each request on a worker thread; returns how many
    were sent once all have ended. With `max_in_flight` requests open the next arrival waits (the stack is slower than
    the rate), and says so."""
    rng = random.Random(seed)
    slots = threading.BoundedSemaphore(max_in_flight)
    sent, end, next_at, last_log = 0, time.monotonic() + seconds, time.monotonic(), time.monotonic()

    def run(request_seed: int) -> None:
        try:
            _one(clients, request_seed, kinds, tally)
        finally:
            slots.release()

    with ThreadPoolExecutor(max_in_flight, thread_name_prefix="soak-client") as pool:
        while (now := time.monotonic()) < end and not stop.is_set():
            if next_at > now:
                stop.wait(min(next_at - now, end - now))
                continue
            if not slots.acquire(timeout=1.0):
                log.warning("the stack is behind the rate: every client slot is busy",
                            extra={"max_in_flight": max_in_flight})
                continue
            pool.submit(run, rng.randrange(1 << 62))
            sent += 1
            next_at += rng.expovariate(rate)
            if now - last_log >= 60:
                last_log = now
                log.info("soak progress", extra={"sent": sent, "left_s": round(end - now)})
    return sent


def _report_rss(samples: Samples, warmup_s: float, load_end_s: float, idle_s: float) -> dict[str, dict]:
    window = max(2 * samples.every_s, min(30.0, (load_end_s - warmup_s) / 20))
    half = (warmup_s + load_end_s) / 2
    out = {}
    for name in samples.series:
        start, mid = samples.at(name, warmup_s, window), samples.at(name, half, window)
        end, idle = samples.at(name, load_end_s, window), samples.at(name, idle_s, samples.every_s)
        second = (end - mid) / mid
        out[name] = {"start_mib": round(start, 1), "half_mib": round(mid, 1), "end_mib": round(end, 1),
                     "idle_mib": round(idle, 1), "first_half_growth_pct": round(100 * (mid - start) / start, 2),
                     "second_half_growth_pct": round(100 * second, 2),
                     "second_half_mib_per_min": round((end - mid) / ((load_end_s - half) / 60), 3),
                     "meets_bar": second < GROWTH_BAR, "pids": sorted(samples.pids[name]),
                     "most_threads": samples.threads[name],
                     "series": [(round(t, 1), round(m, 1)) for t, m in samples.series[name]]}
    return out


def _table(report: dict) -> str:
    lines = [f"soak: {report['minutes']} min of load at {report['rate']} req/s ({report['sent']} requests), "
             f"model {report['model']}, {report['shards']} shard(s)",
             f"{'service':<10} {'start':>8} {'half':>8} {'end':>8} {'idle':>8} {'1st half':>9} {'2nd half':>9} "
             f"{'MiB/min':>8} {'threads':>7}  bar (<{GROWTH_BAR:.0%})"]
    for name, r in report["rss"].items():
        lines.append(f"{name:<10} {r['start_mib']:>8} {r['half_mib']:>8} {r['end_mib']:>8} {r['idle_mib']:>8} "
                     f"{r['first_half_growth_pct']:>8}% {r['second_half_growth_pct']:>8}% "
                     f"{r['second_half_mib_per_min']:>8} {r['most_threads']:>7}  "
                     f"{'ok' if r['meets_bar'] else 'MISSED'}")
    lines.append("outcomes: " + ", ".join(f"{k} {n}" for k, n in report["outcomes"].items()))
    lines.append(f"unexpected: {report['unexpected'] or 'none'}")
    lines.append(f"held by the shards at idle: {report['held_at_idle']}")
    lines.append(f"restarted services: {report['restarted'] or 'none'}")
    return "\n".join(lines)


def soak(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="kimiserve-soak-"))
    port, http_port = free_ports(2)
    up_args = ["--device", args.device, "--shards", str(args.shards), "--port", str(port), "--http-port",
               str(http_port), "--state-dir", str(work / "state"),
               *(("--model", str(args.model)) if args.model else ())]
    log.info("starting the stack", extra={"up_args": up_args, "log": str(work / "up.log")})
    stack = Stack(up_args, work / "up.log", STARTUP_TIMEOUT_S)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="soak", max_retries=0, timeout=120)
        clients = Clients(sdk, router_pb2_grpc.RouterStub(channel), sdk.models.list().data[0].id)
        return _run(stack, clients, args, work)
    finally:
        channel.close()
        stack.stop()


def _run(stack: Stack, clients: Clients, args: argparse.Namespace, work: Path) -> int:
    seconds = args.minutes * 60
    warmup_s = min(60.0, seconds / 10)  # one-time allocations (pools, caches, the first long prompt) settle first
    tally = Tally()
    started = time.monotonic()
    samples = Samples(stack, args.sample_s, started)
    samples.take()
    samples.start()
    log.info("load running", extra={"minutes": args.minutes, "rate": args.rate, "work_dir": str(work)})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C ends the load early; the report covers what ran
        signal.signal(sig, lambda signum, _frame: stop.set())
    sent = drive(clients, args.rate, seconds, args.seed, args.max_in_flight, args.kinds, tally, stop)
    load_end_s = time.monotonic() - started  # every request has ended: drive's pool waited for them
    seconds = load_end_s
    time.sleep(args.idle_s)
    samples.stop()
    samples.take()
    idle_at = time.monotonic() - started
    shards: list[Service] = [s for s in stack.services if s.name.startswith("shard")]
    held_at_idle = {s.name: held(s) for s in shards}
    report = {
        "model": clients.model, "shards": args.shards, "kinds": list(args.kinds), "minutes": round(seconds / 60, 2),
        "rate": args.rate,
        "sent": sent, "warmup_s": warmup_s, "idle_s": args.idle_s,
        "outcomes": {f"{k} {o}": n for (k, o), n in sorted(tally.outcomes.items())},
        "unexpected": tally.unexpected(),
        "held_at_idle": held_at_idle,
        "restarted": {n: len(p) - 1 for n, p in samples.pids.items() if len(p) > 1},
        "rss": _report_rss(samples, warmup_s, load_end_s, idle_at),
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    sys.stdout.write(_table(report) + f"\nreport: {args.out}  logs: {work / 'up.log'}\n")
    leaked = any(v for h in held_at_idle.values() for k, v in h.items() if k in HELD_GAUGES)
    missed = [n for n, r in report["rss"].items() if not r["meets_bar"]]
    return 1 if missed or report["unexpected"] or leaked or report["restarted"] else 0


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in MIX]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown request kinds {unknown} (known: {', '.join(MIX)})" if unknown
                                         else "no request kind given")
    return kinds


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=float(env("SOAK_MINUTES", 60)), help="minutes of load")
    p.add_argument("--rate", type=float, default=float(env("SOAK_RATE", 2)), help="requests per second")
    p.add_argument("--shards", type=int, default=int(env("SOAK_SHARDS", 1)))
    p.add_argument("--device", default=env("SOAK_DEVICE", "cpu"))
    p.add_argument("--model", type=Path, default=env("SOAK_MODEL"), help="default: up's trained default model")
    p.add_argument("--sample-s", type=float, default=float(env("SOAK_SAMPLE_S", 5)), help="seconds between samples")
    p.add_argument("--idle-s", type=float, default=float(env("SOAK_IDLE_S", 30)), help="idle seconds after the load")
    p.add_argument("--max-in-flight", type=int, default=int(env("SOAK_MAX_IN_FLIGHT", 64)))
    p.add_argument("--seed", type=int, default=int(env("SOAK_SEED", 0)))
    p.add_argument("--kinds", type=_kinds, default=_kinds(env("SOAK_KINDS", ",".join(MIX))),
                   help="comma-separated request kinds to send (default: all): " + ", ".join(MIX))
    p.add_argument("--out", type=Path, default=Path(env("SOAK_OUT", "soak-report.json")))
    args = p.parse_args(argv)
    setup_logging("soak")
    for name in ("httpx", "httpx2"):  # the SDK's HTTP client logs every request at INFO
        logging.getLogger(name).setLevel(logging.WARNING)
    return soak(args)


if __name__ == "__main__":
    sys.exit(main())
