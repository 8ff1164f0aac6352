"""Small client helpers for the service tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import grpc

from kimiserve.internal_auth import TOKEN_HEADER
from kimiserve.v1 import common_pb2, router_pb2, shard_pb2, shard_pb2_grpc


def sampling(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


def generate(stub, ids=None, text=None, timeout=120, **kw):
    """Runs one Generate; returns (token_ids, text, last chunk)."""
    req = router_pb2.GenerateRequest(sampling=sampling(**kw))
    if text is not None:
        req.text = text
    else:
        req.prompt_token_ids.ids.extend(ids)
    ids_out, text_out, last = [], "", None
    for chunk in stub.Generate(req, timeout=timeout):
        ids_out.extend(chunk.token_ids)
        text_out += chunk.text
        last = chunk
    return ids_out, text_out, last


def cli_json(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {series with labels: value}."""
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    series = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def total(series: dict[str, float], metric: str) -> float:
    return sum(v for k, v in series.items() if k == metric or k.startswith(metric + "{"))


def shard_load(address: str, internal_token: str | None = None) -> shard_pb2.ShardLoadResponse:
    """The shard's Load answer; `internal_token`: the stack's (`kimiserve up` always runs with one)."""
    metadata = ((TOKEN_HEADER, internal_token),) if internal_token else ()
    with grpc.insecure_channel(address) as ch:
        return shard_pb2_grpc.ShardStub(ch).Load(shard_pb2.ShardLoadRequest(), metadata=metadata, timeout=10)


def wait_until(predicate, timeout: float = 30.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
