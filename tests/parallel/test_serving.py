"""A shard group behind the router, as `kimiserve up --tp 2 --ep 2` starts it: exact usage under concurrency, metrics
from every rank with a rank label, and a killed rank failing the group loudly (requests end with the error, the
shard exits 1, the router takes it out of rotation)."""

from __future__ import annotations

import ipaddress
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from launcher.up import start_stack, stop_stack
from shard_svc.checkpoint.loader import load_model
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.make_tiny import make_tiny
from shard_svc.ops import select_ops
from tests.services.helpers import scrape, wait_until

SHARD_ARGS = ("--num-state-slots", "8", "--num-kv-blocks", "256", "--max-model-len", "512", "--group-timeout", "5")
PROMPTS = {f"c{i}": ([i + 3] * (3 + 2 * i), 4 + 3 * i) for i in range(6)}  # id -> (prompt ids, max_tokens)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny("kimi_k3", tmp_path_factory.mktemp("serving") / "k3", seed=6, layers=14)


@pytest.fixture(scope="module")
def stack(model):
    children = start_stack(model, 1, "cpu", "127.0.0.1", free_port(), timeout=180, shard_args=SHARD_ARGS, tp=2,
                           ep=2)
    channel = grpc.insecure_channel(children[-1].address)
    yield {c.name: c for c in children}, router_pb2_grpc.RouterStub(channel)
    channel.close()
    stop_stack(children, grace_s=20)


def request(ids: list[int], max_tokens: int) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                        ignore_eos=True))
    req.prompt_token_ids.ids.extend(ids)
    return req


def one_process_tokens(model: Path) -> dict[str, list[int]]:
    cfg, m = load_model(model, "cpu", torch.float32)
    engine = Engine(cfg, m, select_ops(torch.device("cpu"), "eager"), torch.device("cpu"), EngineConfig())
    return {rid: engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), rid).output
            for rid, (ids, n) in PROMPTS.items()}


def test_concurrent_requests_match_one_process_with_exact_usage(stack, model):
    children, stub = stack
    time.sleep(7)  # idle for longer than --group-timeout: rank 0's heartbeats keep the followers' waits short
    got: dict[str, tuple] = {}

    def one(rid: str) -> None:
        ids, n = PROMPTS[rid]
        out, last = [], None
        for chunk in stub.Generate(request(ids, n), timeout=120):
            out.extend(chunk.token_ids)
            last = chunk
        got[rid] = (out, last.usage.prompt_tokens, last.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(rid,)) for rid in PROMPTS]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    expected = one_process_tokens(model)
    assert got == {rid: (expected[rid], len(PROMPTS[rid][0]), PROMPTS[rid][1]) for rid in PROMPTS}


def test_metrics_come_from_every_rank_with_a_rank_label(stack):
    children, stub = stack
    list(stub.Generate(request([5, 6, 7], 3), timeout=60))
    series = scrape(children["shard-0"].metrics_url)
    prefill = ("seconds", "sequences", "tokens", "chunks", "max_chunk_tokens")
    for rank in ("0", "1"):  # every rank reports its own passes: the full prefill record, and decode steps
        for hist in [f"kimiserve_shard_prefill_pass_{p}_count" for p in prefill] + [
                "kimiserve_shard_decode_step_seconds_count"]:
            assert series.get(f'{hist}{{rank="{rank}",shard="shard-0"}}', 0) > 0, (hist, rank)
    for p in prefill[1:]:  # the same plan on every rank: the same pass shapes
        sums = {r: series[f'kimiserve_shard_prefill_pass_{p}_sum{{rank="{r}",shard="shard-0"}}'] for r in "01"}
        assert sums["0"] == sums["1"] > 0, (p, sums)
    # Per-request timings are the group's, reported once by rank 0 (the only rank that owns sequences).
    assert series['kimiserve_shard_time_to_first_token_seconds_count{rank="0",shard="shard-0"}'] > 0
    assert not any('rank="1"' in k for k in series if k.startswith("kimiserve_shard_time_to_first_token"))
    # Token counts are the group's, reported once by the rank that owns the sequences.
    assert series['kimiserve_shard_decode_tokens_total{rank="0",shard="shard-0"}'] > 0
    assert not any('rank="1"' in k for k in series if k.startswith("kimiserve_shard_decode_tokens"))


def _listening(pid: int) -> list[tuple[str, int]]:
    """(local address, port) of every TCP socket process `pid` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                out.append((_ip(address), int(port, 16)))
    return out


def _ip(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))  # /proc: host-order words
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)


def test_the_group_listens_on_loopback_only(stack):
    """The store and gloo authenticate nothing: every socket the group's ranks listen on is on loopback (the
    shard's own gRPC and metrics ports are the service's, bound as --host says)."""
    children, _ = stack
    shard = children["shard-0"]
    service_ports = {int(shard.address.rsplit(":", 1)[1]), int(shard.metrics_url.rsplit(":", 1)[1].split("/")[0])}
    workers = [int(p) for p in Path(f"/proc/{shard.proc.pid}/task/{shard.proc.pid}/children").read_text().split()]
    sockets = [(pid, address, port) for pid in (shard.proc.pid, *workers) for address, port in _listening(pid)
               if port not in service_ports]
    assert workers and sockets, "found no rank or no group socket to check"
    assert all(ipaddress.ip_address(address).is_loopback for _, address, _ in sockets), sockets


def test_killed_rank_fails_the_group_loudly(stack):
    """Last in this module: it breaks the stack."""
    children, stub = stack
    shard = children["shard-0"]
    (worker,) = (int(p) for p in Path(f"/proc/{shard.proc.pid}/task/{shard.proc.pid}/children").read_text().split())
    outcome: dict[str, object] = {}
    streaming = threading.Event()

    def long_request() -> None:
        n = 0
        try:
            for chunk in stub.Generate(request([1, 2, 3], 400), timeout=120):
                n += len(chunk.token_ids)
                streaming.set()
            outcome["done"] = (n, chunk.finish_reason, chunk.error_message)
        except grpc.RpcError as e:
            outcome["error"] = (e.code(), e.details())

    thread = threading.Thread(target=long_request)
    thread.start()
    assert streaming.wait(60)
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(60)
    assert shard.proc.wait(60) == 1 and time.monotonic() - killed < 30
    detail = str(outcome)
    assert "shard group failed" in detail and f"rank 1 (pid {worker}) was killed by SIGKILL" in detail, outcome
    router_metrics = children["router"].metrics_url
    wait_until(lambda: scrape(router_metrics).get(f'kimiserve_router_shard_healthy{{shard="{shard.address}"}}') == 0.0,
               30, "the router to take the failed group out of rotation")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request([4], 2), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
