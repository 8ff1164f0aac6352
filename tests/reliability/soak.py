"""`make soak`: a stack (tokenizer, two shards, router as real processes) under a random mix of traffic for
SOAK_MINUTES (default 5), then a report of what it served and what it leaked.

The mix, from SOAK_CONCURRENCY (default 16) client threads: good requests (token-id and text completions, chats;
each must finish with exact usage), invalid ones (each must be refused INVALID_ARGUMENT), streams the client cancels
after a few chunks, streams whose channel the client closes mid-stream, streams cut by a short deadline, and every
30 s a client process SIGKILLed mid-stream (its TCP connections drop without a goodbye).

At the end, with the traffic stopped: slots and KV blocks still held by the shards (their gauges and their Load
answer; must be 0), router / shard / tokenizer RSS growth since the end of the warm-up, the longest stall between two
chunks of a good stream, and outcomes by kind and status, client side and as the router counted them. Writes the
report as JSON to SOAK_OUT (default soak-report.json) and a table to stdout. Exit 1 if anything leaked or any request
ended other than its kind allows.

Not collected by pytest (no test_ prefix): `make soak` or `python -m tests.reliability.soak`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kimiserve.logs import setup_logging
from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc, shard_pb2, shard_pb2_grpc
from launcher.up import Child, start_stack, stop_stack
from tests.services.helpers import scrape, shard_load, total

log = logging.getLogger("soak")
SHARD_ARGS = ("--num-state-slots", "8", "--num-kv-blocks", "256", "--max-model-len", "512")
# kind -> weight in the mix
MIX = {"generate": 40, "text": 15, "chat": 15, "invalid": 6, "cancel": 10, "disconnect": 8, "deadline": 6}
# kind -> the client-side outcomes it may end with ("OK": finished with exact usage)
ALLOWED = {"generate": {"OK"}, "text": {"OK"}, "chat": {"OK"}, "invalid": {"INVALID_ARGUMENT"},
           "cancel": {"CANCELLED", "OK"}, "disconnect": {"CANCELLED", "OK"}, "deadline": {"DEADLINE_EXCEEDED", "OK"},
           "killed-client": {"KILLED"}}
KILLED_CLIENT_EVERY_S = 30.0
WARMUP_S = 20.0


def _sampling(rng: random.Random, max_tokens: int) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                  temperature=rng.choice([0.0, 0.0, 0.7, 1.0]))
    if s.temperature:
        s.seed, s.top_p = rng.randrange(1 << 30), rng.choice([1.0, 0.9])
    return s


def _invalid(rng: random.Random):
    """One request the router must refuse with INVALID_ARGUMENT (a representative few; the catalogue of bad
    inputs is tests/reliability/test_bad_inputs.py)."""
    gen = router_pb2.GenerateRequest
    choice = rng.randrange(6)
    if choice == 0:
        return "Generate", gen(prompt_token_ids=common_pb2.TokenIds(ids=[5, 6]),
                               sampling=common_pb2.SamplingParams(max_tokens=0))
    if choice == 1:
        return "Generate", gen(prompt_token_ids=common_pb2.TokenIds(ids=[5, 6]),
                               sampling=common_pb2.SamplingParams(max_tokens=4, temperature=-1.0))
    if choice == 2:
        return "Generate", gen(prompt_token_ids=common_pb2.TokenIds(ids=[5, 10**7]))
    if choice == 3:
        return "Generate", gen(sampling=common_pb2.SamplingParams(max_tokens=4))  # no prompt
    if choice == 4:
        return "Generate", gen(prompt_token_ids=common_pb2.TokenIds(ids=[5]),
                               sampling=common_pb2.SamplingParams(max_tokens=4, top_p=1.5))
    return "Chat", router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="wizard", content="hi")])


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome) -> count
    unexpected: list = field(default_factory=list)  # a few examples
    tokens: int = 0
    longest_stall_s: float = 0.0
    longest_first_token_s: float = 0.0

    def record(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1
            if outcome not in ALLOWED[kind] and len(self.unexpected) < 20:
                self.unexpected.append({"kind": kind, "outcome": outcome, "detail": detail[:300]})

    def stream_timing(self, first_token_s: float, stall_s: float, tokens: int) -> None:
        with self.lock:
            self.longest_first_token_s = max(self.longest_first_token_s, first_token_s)
            self.longest_stall_s = max(self.longest_stall_s, stall_s)
            self.tokens += tokens


def _good(stub, kind: str, rng: random.Random, tally: Tally) -> None:
    max_tokens = rng.randint(1, 48)
    s = _sampling(rng, max_tokens)
    if kind == "chat":
        call = stub.Chat(router_pb2.ChatRequest(
            messages=[common_pb2.ChatMessage(role="user", content=f"Tell me about {rng.randrange(1000)}")],
            sampling=s), timeout=120)
    elif kind == "text":
        call = stub.Generate(router_pb2.GenerateRequest(text=f"Once upon a time {rng.randrange(1000)}",
                                                        sampling=s), timeout=120)
    else:
        ids = [rng.randrange(3, 200) for _ in range(rng.randint(1, 40))]
        call = stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=ids),
                                                        sampling=s), timeout=120)
    sent = last_at = time.monotonic()
    first_s, stall, streamed, last = None, 0.0, 0, None
    try:
        for chunk in call:
            now = time.monotonic()
            if first_s is None:
                first_s = now - sent
            else:
                stall = max(stall, now - last_at)
            last_at, last = now, chunk
            streamed += len(chunk.token_ids)
    except grpc.RpcError as e:
        tally.record(kind, e.code().name, e.details() or "")
        return
    usage = last.usage.completion_tokens if last is not None else -1
    if usage != streamed or streamed != max_tokens:
        tally.record(kind, "WRONG_USAGE", f"streamed {streamed}, usage {usage}, max_tokens {max_tokens}")
        return
    tally.stream_timing(first_s, stall, streamed)
    tally.record(kind, "OK")


def _cut_short(stub, channel_factory, kind: str, rng: random.Random, tally: Tally) -> None:
    """A stream the client abandons: cancel after a few chunks, close its channel, or a short deadline."""
    req = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[rng.randrange(3, 200)] * 8),
                                     sampling=_sampling(rng, 200))
    channel = channel_factory() if kind == "disconnect" else None
    stub = router_pb2_grpc.RouterStub(channel) if channel is not None else stub
    call = stub.Generate(req, timeout=rng.uniform(0.05, 0.5) if kind == "deadline" else 120)
    keep = rng.randint(1, 5)
    try:
        for i, _ in enumerate(call):
            if i + 1 >= keep and kind == "cancel":
                call.cancel()
            elif i + 1 >= keep and kind == "disconnect":
                channel.close()
        tally.record(kind, "OK")
    except grpc.RpcError as e:
        tally.record(kind, e.code().name, e.details() or "")
    finally:
        if channel is not None:
            channel.close()


def _worker(address: str, stub, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items())
    while time.monotonic() < until:
        kind = rng.choices(kinds, weights)[0]
        try:
            if kind in ("generate", "text", "chat"):
                _good(stub, kind, rng, tally)
            elif kind == "invalid":
                method, req = _invalid(rng)
                try:
                    for _ in getattr(stub, method)(req, timeout=30):
                        pass
                    tally.record(kind, "OK")
                except grpc.RpcError as e:
                    tally.record(kind, e.code().name, e.details() or "")
            else:
                _cut_short(stub, lambda: grpc.insecure_channel(address), kind, rng, tally)
        except Exception as e:  # noqa: BLE001 - a client-side bug is reported, not allowed to end the soak early
            tally.record(kind, f"CLIENT_ERROR {type(e).__name__}", str(e))


KILLED_CLIENT = """
import sys, grpc
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc, shard_pb2, shard_pb2_grpc
stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(sys.argv[1]))
calls = [stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[7, 8, i + 3]),
         sampling=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True))) for i in range(4)]
for c in calls:
    next(c)
sys.stdout.write("streaming\\n"); sys.stdout.flush()
for c in calls:
    for _ in c:
        pass
"""


def _killed_clients(address: str, until: float, tally: Tally, stop: threading.Event) -> None:
    """Every KILLED_CLIENT_EVERY_S: a client process with 4 streams, SIGKILLed once all are streaming."""
    while not stop.wait(KILLED_CLIENT_EVERY_S) and time.monotonic() < until:
        proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, address], stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        line = proc.stdout.readline()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        tally.record("killed-client", "KILLED" if line.strip() == b"streaming" else "CLIENT_NEVER_STREAMED")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _capacity(shard: Child) -> shard_pb2.ShardCapacity:
    with grpc.insecure_channel(shard.address) as ch:
        return shard_pb2_grpc.ShardStub(ch).Info(shard_pb2.ShardInfoRequest(), timeout=10).capacity


def _held(shards: list[Child], capacity: dict[str, shard_pb2.ShardCapacity]) -> dict[str, dict[str, float]]:
    """What each shard still holds, by its gauges and by its own Load answer (slots and blocks not free)."""
    out = {}
    for s in shards:
        series, load = scrape(s.metrics_url), shard_load(s.address)
        out[s.name] = {"state_slots_used_gauge": total(series, "kimiserve_shard_state_slots_used"),
                       "kv_blocks_used_gauge": total(series, "kimiserve_shard_kv_blocks_used"),
                       "running_seqs": load.running_seqs, "queued_seqs": load.queued_seqs,
                       "state_slots_not_free": capacity[s.name].state_slots - load.free_state_slots,
                       "kv_blocks_not_free": capacity[s.name].kv_blocks - load.free_kv_blocks}
    return out


def _leaks(held: dict[str, dict[str, float]]) -> float:
    return sum(sum(v.values()) for v in held.values())


def soak(minutes: float, concurrency: int, family: str, out: Path, seed: int) -> int:
    from shard_svc.make_tiny import make_tiny

    work = Path(tempfile.mkdtemp(prefix="kimiserve-soak-"))
    model = make_tiny(family, work / f"tiny-{family}", seed=0)
    children = start_stack(model, 2, "cpu", "127.0.0.1", free_port(), timeout=300, shard_args=SHARD_ARGS,
                           router_args=("--batch-db", str(work / "batches.sqlite3"), "--max-queued", "256"))
    try:
        return _run(children, minutes, concurrency, out, seed, family)
    finally:
        stop_stack(children)


def _run(children: list[Child], minutes: float, concurrency: int, out: Path, seed: int, family: str) -> int:
    by_name = {c.name: c for c in children}
    shards = [c for c in children if c.role == "shard"]
    router = by_name["router"]
    channel = grpc.insecure_channel(router.address)
    stub = router_pb2_grpc.RouterStub(channel)
    tally = Tally()
    started = time.monotonic()
    until = started + minutes * 60
    stop = threading.Event()
    threads = [threading.Thread(target=_worker, args=(router.address, stub, seed + i, until, tally), daemon=True)
               for i in range(concurrency)]
    threads.append(threading.Thread(target=_killed_clients, args=(router.address, until, tally, stop), daemon=True))
    for t in threads:
        t.start()
    log.info("soak running", extra={"minutes": minutes, "concurrency": concurrency, "router": router.address})
    time.sleep(min(WARMUP_S, minutes * 60 / 10))  # one-time allocations (weights, pools, caches) settle first
    rss_start = {c.name: _rss_mib(c.pid) for c in children}
    while any(t.is_alive() for t in threads[:-1]):
        time.sleep(5)
        log.info("soak progress", extra={"elapsed_s": round(time.monotonic() - started),
                                         "requests": sum(tally.outcomes.values())})
    stop.set()
    threads[-1].join(60)
    elapsed = time.monotonic() - started

    capacity = {s.name: _capacity(s) for s in shards}
    held, deadline = _held(shards, capacity), time.monotonic() + 60  # drain: wait for the shards to settle
    while _leaks(held) and time.monotonic() < deadline:
        time.sleep(0.5)
        held = _held(shards, capacity)
    rss_end = {c.name: _rss_mib(c.pid) for c in children}
    router_series = scrape(router.metrics_url)
    router_codes = Counter()
    for key, value in router_series.items():
        if key.startswith("kimiserve_router_requests_total{"):
            status = key.split('status="', 1)[1].split('"', 1)[0]
            router_codes[status] += int(value)
    channel.close()

    unexpected = sum(n for (kind, outcome), n in tally.outcomes.items() if outcome not in ALLOWED[kind])
    report = {
        "model": family, "minutes": round(elapsed / 60, 2), "concurrency": concurrency, "seed": seed,
        "requests": sum(tally.outcomes.values()),
        "served_ok": sum(n for (kind, outcome), n in tally.outcomes.items() if outcome == "OK"),
        "tokens_streamed_by_good_requests": tally.tokens,
        "outcomes": {f"{kind} {outcome}": n for (kind, outcome), n in sorted(tally.outcomes.items())},
        "router_requests_by_status": dict(sorted(router_codes.items())),
        "unexpected": unexpected, "unexpected_examples": tally.unexpected,
        "leaked": _leaks(held), "held_after_drain": held,
        "rss_mib": {n: {"start": round(rss_start[n], 1), "end": round(rss_end[n], 1),
                        "growth": round(rss_end[n] - rss_start[n], 1)} for n in rss_start},
        "longest_stall_s": round(tally.longest_stall_s, 3),
        "longest_first_token_s": round(tally.longest_first_token_s, 3),
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    _table(report, out)
    return 1 if report["leaked"] or unexpected else 0


def _table(r: dict, out: Path) -> None:
    rows = [("duration", f"{r['minutes']} min, {r['concurrency']} client threads, model {r['model']}"),
            ("requests", f"{r['requests']} ({r['served_ok']} OK, {r['tokens_streamed_by_good_requests']} tokens "
                         "in good streams)"),
            ("router statuses", ", ".join(f"{k} {v}" for k, v in r["router_requests_by_status"].items())),
            ("unexpected outcomes", str(r["unexpected"])),
            ("leaked slots+blocks", str(r["leaked"])),
            ("RSS growth (MiB)", ", ".join(f"{n} {v['growth']:+.1f}" for n, v in r["rss_mib"].items())),
            ("longest stall", f"{r['longest_stall_s']} s between chunks (first token: {r['longest_first_token_s']}"
                              " s at most)")]
    rows += [(f"  {k}", str(v)) for k, v in r["outcomes"].items()]
    width = max(len(k) for k, _ in rows)
    sys.stdout.write("\n".join(f"{k:<{width}}  {v}" for k, v in rows) + f"\nreport: {out}\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", 5)))
    p.add_argument("--concurrency", type=int, default=int(os.environ.get("SOAK_CONCURRENCY", 16)))
    p.add_argument("--family", default=os.environ.get("SOAK_FAMILY", "kimi_linear"), help="tiny model family")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("SOAK_OUT", "soak-report.json")))
    p.add_argument("--seed", type=int, default=int(os.environ.get("SOAK_SEED", 0)))
    a = p.parse_args()
    setup_logging("soak")
    return soak(a.minutes, a.concurrency, a.family, a.out, a.seed)


if __name__ == "__main__":
    sys.exit(main())
