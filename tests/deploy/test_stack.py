"""The chart's containers run for real: the test renders the chart (security on, CPU shards), starts each rendered
container's command as a local process (only addresses, ports and the Secret mount root rewritten for loopback),
checks its gRPC probes the way kubelet runs them, sends traffic over TLS with an API key, and has a real Prometheus
scrape the stack. Every dashboard panel expression must return data; every alert rule must evaluate without error.
One shard runs the chart rendered with weight streaming and host KV offload (`shard.weights.*`, `shard.hostKvGb`), so
the streaming panels and alerts are evaluated over a real streaming shard's series too; the other shard runs a
prefix cache with a host tier, so its panels are evaluated over entries that really moved to the host.

Also over the running stack: API keys (missing / wrong → UNAUTHENTICATED, never logged, rotated live), TLS on the
public port, mTLS between router, tokenizer and shards (no client cert or a rogue CA's → refused), and discovery
draining a real shard.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kimiserve import internal_auth, security
from kimiserve.ports import free_port
from kimiserve.v1 import (common_pb2, router_pb2, router_pb2_grpc, shard_pb2, shard_pb2_grpc, tokenizer_pb2,
                          tokenizer_pb2_grpc)
from router.discovery import ShardDiscovery, static_resolver
from router.errors import ShardUnavailable
from router.shard_client import ShardClient
from tests.deploy.certs import write_secret_dirs
from tests.deploy.conftest import REPO, find, helm_template
from tests.deploy.promql import metric_names
from tests.deploy.test_chart import generate

NAMESPACE, MODEL, INTERNAL_NAME = "kimiserve-test", "tiny", "kimiserve-internal"
GOOD_KEY, WRONG_KEY = f"ks-good-{secrets.token_hex(12)}", f"ks-wrong-{secrets.token_hex(12)}"
SHARD_HOSTS = ("127.0.0.1", "127.0.0.2")  # two "pods" with the same ports, as a StatefulSet's are
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
# shard-0 runs the chart rendered with these values too, as every shard of a release with them would (the CPU build of
# the streaming engine: the code a GPU runs). 18 blocks of 4 tokens hold the traffic's longest request (a 60-token
# prompt + 9) alone but not four at once, so KV pages move to the host and back. shard-1 stays resident: the discovery
# test gives it a 500-token sequence, which that cache would refuse. The streaming shard keeps no prefix cache: its
# entries' blocks are evicted before any sequence is offloaded, which made whether this traffic ever offloads depend
# on timing.
STREAMING_SHARD = "shard-0"
# The resident shard keeps 2 prefix cache entries on the device and 8 in its host tier, so the traffic's distinct
# prompts push entries to the host and the host tier's panels are evaluated over real series.
RESIDENT_VALUES = ("--set-json", 'shard.extraArgs=["--prefix-cache-entries", "2", "--prefix-host-entries", "8"]')
STREAMING_VALUES = ("--set", "shard.weights.mode=stream", "--set", "shard.weights.prefetchDepth=2",
                    "--set", "shard.weights.slots=4", "--set-json", "shard.weights.pinnedMemoryGb=0.5",
                    "--set-json", "shard.hostKvGb=0.01", "--set", "shard.kvBlockSize=4",
                    "--set", "shard.numKvBlocks=18",
                    "--set-json", 'shard.extraArgs=["--prefix-cache-entries", "0"]')


@dataclass
class Proc:
    name: str
    host: str
    container: dict
    proc: subprocess.Popen
    log: Path

    def port(self, name: str) -> int:
        return next(p["containerPort"] for p in self.container["ports"] if p["name"] == name)

    def tail(self) -> str:
        return f"--- {self.name} ---\n" + "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


@dataclass
class Stack:
    procs: dict[str, Proc]
    etc: Path
    secret_paths: dict[str, Path]
    prometheus: str = ""
    traffic: dict = field(default_factory=dict)

    @property
    def router(self) -> Proc:
        return self.procs["router"]

    def router_channel(self) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials((self.etc / "router-tls" / "ca.crt").read_bytes())
        return grpc.secure_channel(f"127.0.0.1:{self.router.port('grpc')}", creds)

    def internal_creds(self, client_cert_dir: str | None = "internal-tls") -> grpc.ChannelCredentials:
        ca = (self.etc / "internal-tls" / "ca.crt").read_bytes()
        if client_cert_dir is None:
            return grpc.ssl_channel_credentials(ca)
        d = self.etc / client_cert_dir
        return grpc.ssl_channel_credentials(ca, (d / "tls.key").read_bytes(), (d / "tls.crt").read_bytes())

    @property
    def internal_token(self) -> bytes:
        return internal_auth.read_token(self.etc / "internal-token" / "token")

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs.values())


def probe_ok(host: str, port: int, creds: grpc.ChannelCredentials | None = None, service: str = "") -> bool:
    """What kubelet's native gRPC probe does: grpc.health.v1 Check over plaintext (or TLS, for our own checks)."""
    target = f"{host}:{port}"
    options = [("grpc.ssl_target_name_override", INTERNAL_NAME)] if creds else None
    channel = grpc.secure_channel(target, creds, options=options) if creds else grpc.insecure_channel(target)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def local_command(container: dict, host: str, pod_name: str, etc: Path, rewrites: dict[str, str]) -> list[str]:
    """The container's command line for a loopback process: the image's `kimiserve` entry point, and only the
    listen host, cluster DNS names, pod name and Secret mount root changed."""
    assert container["command"] == ["kimiserve"]
    out = []
    for arg in container["args"]:
        arg = arg.replace("/etc/kimiserve/", f"{etc}/").replace("$(POD_NAME)", pod_name)
        arg = arg.replace("/var/lib/kimiserve/", f"{etc.parent}/var-lib-kimiserve/")  # the batch-store volume
        arg = f"--host={host}" if arg == "--host=0.0.0.0" else arg
        for old, new in rewrites.items():
            arg = arg.replace(old, new)
        out.append(arg)
    return [sys.executable, "-m", "launcher.cli", *out]


def start(name: str, cmd: list[str], container: dict, host: str, root: Path) -> Proc:
    log = root / f"{name}.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Proc(name, host, container, proc, log)


def wait_probes(p: Proc, timeout: float = 240) -> None:
    """Startup probe until it passes (the process must stay up), then liveness and readiness must pass too."""
    port = p.container["startupProbe"]["grpc"]["port"]
    end = time.monotonic() + timeout
    while not probe_ok(p.host, port):
        if p.proc.poll() is not None:
            pytest.fail(f"{p.name} exited with {p.proc.returncode} before its startup probe passed\n{p.tail()}")
        if time.monotonic() > end:
            pytest.fail(f"{p.name}: startup probe on port {port} did not pass in {timeout} s\n{p.tail()}")
        time.sleep(0.3)
    for probe in PROBES:
        assert probe_ok(p.host, p.container[probe]["grpc"]["port"]), f"{p.name} {probe} fails\n{p.tail()}"


def stop(procs: list[Proc]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.proc.wait(30)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()


@pytest.fixture(scope="module")
def stack(helm_bin, tiny_linear, tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    model = tiny_linear
    etc = root / "etc"
    secret_paths = write_secret_dirs(etc, INTERNAL_NAME, f"# test keys\n{GOOD_KEY}\n")
    values = {
        "model.source": "hostPath", "model.hostPath.path": str(model), "model.mountPath": str(model),
        "model.name": MODEL, "security.tls.enabled": "true", "security.apiKeys.enabled": "true",
        "security.mtls.enabled": "true", "security.mtls.serverName": INTERNAL_NAME,
        "shard.gpus": "0", "shard.dtype": "float32", "shard.numStateSlots": "4", "shard.numKvBlocks": "256",
        "shard.maxModelLen": "512", "router.discoveryIntervalSeconds": "1", "router.drainTimeoutSeconds": "10",
    }
    for key in ("router.port", "router.metricsPort", "router.healthPort", "router.http.port", "tokenizer.port",
                "tokenizer.metricsPort", "tokenizer.healthPort", "shard.port", "shard.metricsPort", "shard.healthPort"):
        values[key] = str(free_port())
    args = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    docs = helm_template(helm_bin, *args, *RESIDENT_VALUES)
    # The chart's generated internal token, where its Secret volume would put it (all three read the same file).
    token = base64.b64decode(find(docs, "Secret", "-internal-token")["data"]["token"])
    (etc / "internal-token").mkdir()
    (etc / "internal-token" / "token").write_bytes(token)
    containers = {c: find(docs, kind, f"-{c}")["spec"]["template"]["spec"]["containers"][0]
                  for c, kind in (("router", "Deployment"), ("tokenizer", "Deployment"), ("shard", "StatefulSet"))}
    streaming = find(helm_template(helm_bin, *args, *STREAMING_VALUES), "StatefulSet", "-shard")
    streaming_container = streaming["spec"]["template"]["spec"]["containers"][0]
    assert {"--weights=stream", "--host-kv-gb=0.01"} <= set(streaming_container["args"])
    shard_port = int(values["shard.port"])
    headless = find(docs, "Service", "-shard-headless")["metadata"]["name"]
    tokenizer_svc = find(docs, "Service", "-tokenizer")["metadata"]["name"]
    procs: dict[str, Proc] = {}
    try:
        procs["tokenizer"] = start("tokenizer", local_command(containers["tokenizer"], "127.0.0.1", "tokenizer-0",
                                                              etc, {}), containers["tokenizer"], "127.0.0.1", root)
        for i, host in enumerate(SHARD_HOSTS):
            name = f"shard-{i}"
            container = streaming_container if name == STREAMING_SHARD else containers["shard"]
            procs[name] = start(name, local_command(container, host, name, etc, {}), container, host, root)
        for p in list(procs.values()):
            wait_probes(p)
        # Cluster DNS → loopback: the headless name becomes `localhost` (resolved by the router's discovery, as
        # in a cluster); the second "pod" has another address with the same port, given as a static shard.
        router_cmd = local_command(containers["router"], "127.0.0.1", "router-0", etc, {
            f"{tokenizer_svc}.ml.svc.cluster.local": "127.0.0.1",
            f"{headless}.ml.svc.cluster.local": "localhost"}) + [f"--shards={SHARD_HOSTS[1]}:{shard_port}"]
        procs["router"] = start("router", router_cmd, containers["router"], "127.0.0.1", root)
        wait_probes(procs["router"])
        yield Stack(procs, etc, secret_paths)
    finally:
        stop([procs[n] for n in ("router", "shard-0", "shard-1", "tokenizer") if n in procs])


@pytest.fixture(scope="module")
def prometheus(stack, prometheus_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("prometheus")
    labels = {"namespace": NAMESPACE, "model": MODEL}
    targets = [([f"127.0.0.1:{stack.router.port('metrics')}"], "router"),
               ([f"127.0.0.1:{stack.procs['tokenizer'].port('metrics')}"], "tokenizer"),
               ([f"{h}:{stack.procs['shard-0'].port('metrics')}" for h in SHARD_HOSTS], "shard")]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
              "rule_files": [str(generate.RULES)],
              "scrape_configs": [{"job_name": "kimiserve", "static_configs": [
                  {"targets": t, "labels": {**labels, "component": c}} for t, c in targets]}]}
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = root / "prometheus.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([prometheus_bin, f"--config.file={root / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > end:
                pytest.fail(f"prometheus did not become ready:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        # Targets are picked up a few seconds after start; wait until all four are scraped successfully.
        while len([s for s in api(url, "/api/v1/query", query="up == 1")["data"]["result"]]) < 4:
            if proc.poll() is not None or time.monotonic() > end:
                targets = api(url, "/api/v1/targets")["data"]["activeTargets"]
                pytest.fail(f"prometheus is not scraping all four targets: {targets}\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        stack.prometheus = url
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def api(url: str, path: str, **params) -> dict:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(params)}", timeout=10) as r:
        return json.loads(r.read())


def authed(key: str = GOOD_KEY):
    return (("authorization", f"Bearer {key}"),)


def generate_one(stub, text: str, max_tokens: int, key: str = GOOD_KEY):
    chunks = list(stub.Generate(router_pb2.GenerateRequest(
        text=text, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0)),
        metadata=authed(key), timeout=120))
    return chunks[-1]


@pytest.fixture(scope="module")
def traffic(stack, prometheus):
    """Traffic over TLS with the API key: generates, chats and invalid requests, on both shards. A first round
    creates the labelled series; the rest is spread over several scrapes so that rate() sees increases (a series
    that appears between two scrapes has no increase to Prometheus, as after any process start)."""

    def batch(stub, n):
        items = [router_pb2.BatchRequestItem(custom_id=f"item-{i}", generate=router_pb2.GenerateRequest(
            text=f"batch item {i}", sampling=common_pb2.SamplingParams(max_tokens=4))) for i in range(n)]
        created = stub.CreateBatch(router_pb2.CreateBatchRequest(inline=router_pb2.BatchInlineRequests(
            requests=items)), metadata=authed(), timeout=30)
        return created.id

    def wait_batch(stub, batch_id):
        end = time.monotonic() + 60
        while (b := stub.GetBatch(router_pb2.GetBatchRequest(batch_id=batch_id), metadata=authed(),
                                  timeout=30)).status != router_pb2.BATCH_STATUS_COMPLETED:
            assert time.monotonic() < end, f"batch {batch_id} did not complete: {b}"
            time.sleep(0.2)
        assert b.request_counts.completed == b.request_counts.total > 0

    def round_(stub, pool, i0):
        finals = list(pool.map(lambda i: generate_one(stub, f"hello number {i} " * (1 + i % 5), 6 + i % 4),
                               range(i0, i0 + 8)))
        chat = list(stub.Chat(router_pb2.ChatRequest(
            messages=[common_pb2.ChatMessage(role="user", content="Hi there")],
            sampling=common_pb2.SamplingParams(max_tokens=5)), metadata=authed(), timeout=120))
        with pytest.raises(grpc.RpcError) as bad:
            generate_one(stub, "x", 0)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert all(f.usage.completion_tokens >= 1 and f.finish_reason for f in finals), finals
        assert chat[-1].usage.completion_tokens >= 1
        return finals

    with stack.router_channel() as channel, ThreadPoolExecutor(8) as pool:
        stub = router_pb2_grpc.RouterStub(channel)
        first_batch = batch(stub, 4)
        finals = round_(stub, pool, 0)
        wait_batch(stub, first_batch)
        for i in range(1, 5):
            time.sleep(1.2)  # at least one scrape between rounds
            finals += round_(stub, pool, 8 * i)
            if i == 2:
                wait_batch(stub, batch(stub, 4))
    time.sleep(2.5)  # a few scrapes after the last request
    stack.traffic = {"finals": finals}
    return stack


def _substitute(expr: str) -> str:
    return expr.replace("$namespace", NAMESPACE).replace("$model", MODEL).replace("$__rate_interval", "1m")


def _has_data(result: list[dict]) -> bool:
    return any(not math.isnan(float(s["value"][1])) for s in result)


def test_probes_of_the_rendered_chart_pass_against_the_real_servers(stack):
    for p in stack.procs.values():
        assert p.proc.poll() is None, p.tail()
        for probe in PROBES:
            port = p.container[probe]["grpc"]["port"]
            assert port == p.port("health")  # TLS / mTLS on: probes use the plaintext health-only port
            assert probe_ok(p.host, port), f"{p.name} {probe}"


def test_the_http_port_serves_the_openai_api_over_tls_with_api_keys(stack):
    """The chart's "http" port: the OpenAI-compatible API on the public port's certificate, behind the API keys (the
    open GET /health aside); plaintext is refused."""
    import ssl

    import httpx

    tls = ssl.create_default_context(cafile=str(stack.etc / "router-tls" / "ca.crt"))
    base = f"https://127.0.0.1:{stack.router.port('http')}"
    with httpx.Client(base_url=base, verify=tls, timeout=120) as http:
        assert http.get("/health").json()["status"] == "ok"
        assert http.get("/v1/models").status_code == 401
        assert http.get("/v1/models", headers={"authorization": f"Bearer {WRONG_KEY}"}).status_code == 401
        auth = {"authorization": f"Bearer {GOOD_KEY}"}
        model = http.get("/v1/models", headers=auth).json()["data"][0]["id"]
        reply = http.post("/v1/chat/completions", headers=auth, json={
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
    with pytest.raises(httpx.HTTPError) as plain:  # TLS only, like the gRPC port
        httpx.get(f"http://127.0.0.1:{stack.router.port('http')}/health", timeout=10)
    # A refused connection (nothing listening) would raise too: the port must take it and drop plain HTTP.
    assert not isinstance(plain.value, httpx.ConnectError), f"plain HTTP was not refused by TLS: {plain.value!r}"


def test_router_uses_both_shards_from_dns_and_static_list(traffic):
    shard_port = traffic.procs["shard-0"].port("grpc")
    result = api(traffic.prometheus, "/api/v1/query", query="kimiserve_router_shard_healthy")["data"]["result"]
    healthy = {s["metric"]["shard"]: s["value"][1] for s in result}
    assert healthy == {f"{h}:{shard_port}": "1" for h in SHARD_HOSTS}
    prefill = api(traffic.prometheus, "/api/v1/query",
                  query="sum by (shard) (kimiserve_shard_prefill_tokens_total)")["data"]["result"]
    assert {s["metric"]["shard"] for s in prefill} == {"shard-0", "shard-1"}  # both shards did work


def test_every_dashboard_panel_query_returns_data(traffic):
    dash = json.loads(generate.DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    pending, end = dict(enumerate(exprs)), time.monotonic() + 30
    while pending and time.monotonic() < end:
        for i, (title, expr) in list(pending.items()):
            reply = api(traffic.prometheus, "/api/v1/query", query=_substitute(expr))
            assert reply["status"] == "success", (title, expr, reply)
            if _has_data(reply["data"]["result"]):
                del pending[i]
        time.sleep(1)
    assert not pending, f"panels whose query returned no data: {list(pending.values())}"
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            metric = metric_names(var["query"]["query"]).pop()
            label = var["query"]["query"].rsplit(",", 1)[1].strip(" )")
            values = api(traffic.prometheus, f"/api/v1/label/{label}/values", **{"match[]": metric})["data"]
            assert {"namespace": NAMESPACE, "model": MODEL}[label] in values


def test_dashboard_metric_names_are_all_scraped(traffic):
    scraped = set(api(traffic.prometheus, "/api/v1/label/__name__/values")["data"])
    dash = json.loads(generate.DASHBOARD.read_text())
    named = {n for p in dash["panels"] for t in p.get("targets", []) for n in metric_names(t["expr"])}
    rules = yaml.safe_load(generate.RULES.read_text())["groups"][0]["rules"]
    named |= {n for r in rules for n in metric_names(r["expr"])}
    assert named - scraped == set(), f"named in dashboards/alerts but not scraped: {sorted(named - scraped)}"


def _by_shard(url: str, expr: str) -> dict[str, float]:
    return {s["metric"]["shard"]: float(s["value"][1]) for s in api(url, "/api/v1/query", query=expr)["data"]["result"]}


def test_the_streaming_shard_streams_weights_and_moves_kv_pages(traffic):
    """The streaming panels' data is real: shard-0 streamed its layers and ran its device KV short, and every page
    that went to the host came back (all requests finished); the resident shard exports none of these series."""
    log = traffic.procs[STREAMING_SHARD].log.read_text()
    assert "weights: stream (--weights stream)" in log, traffic.procs[STREAMING_SHARD].tail()
    url = traffic.prometheus
    assert _by_shard(url, "kimiserve_stream_bytes_total").get(STREAMING_SHARD, 0) > 0
    assert _by_shard(url, "kimiserve_stream_slots_total") == {STREAMING_SHARD: 4}
    offloaded = _by_shard(url, "kimiserve_kv_pages_offloaded_total")
    assert offloaded.get(STREAMING_SHARD, 0) > 0, \
        f"the traffic never ran {STREAMING_SHARD}'s KV blocks short (STREAMING_VALUES): {offloaded}"
    assert _by_shard(url, "kimiserve_kv_pages_restored_total") == offloaded
    assert _by_shard(url, "kimiserve_kv_host_pages") == {STREAMING_SHARD: 0}
    assert set(_by_shard(url, "kimiserve_stream_copy_seconds_count")) == {STREAMING_SHARD}


def test_the_resident_shard_moves_prefix_cache_entries_to_its_host_tier(traffic):
    """The host tier panels' data is real: the resident shard evicted device entries into its host tier, which holds
    them in host memory; the streaming shard (no prefix cache) exports none of the prefix cache series."""
    url, resident = traffic.prometheus, "shard-1"
    assert _by_shard(url, "kimiserve_shard_prefix_cache_host_entries_total") == {resident: 8}
    assert _by_shard(url, "kimiserve_shard_prefix_cache_evictions_total")[resident] > 0
    assert 0 < _by_shard(url, "kimiserve_shard_prefix_cache_host_entries")[resident] <= 8
    assert _by_shard(url, "kimiserve_shard_prefix_cache_host_bytes")[resident] > 0


def test_streaming_alert_measures_return_data(traffic):
    """The streaming and host KV alerts compare a measure with a threshold; over the streaming shard the measure
    alone must return data (an alert over series that never match can never fire)."""
    rules = {r["alert"]: r["expr"] for r in yaml.safe_load(generate.RULES.read_text())["groups"][0]["rules"]}
    for alert, measure in (("KimiserveWeightStreamingStalled", generate.STREAM_STALL_SHARE),
                           ("KimiserveHostKVChurn", generate.KV_RESTORE_TURNOVER)):
        assert rules[alert].startswith(f"{measure} > "), (alert, rules[alert])
        result = api(traffic.prometheus, "/api/v1/query", query=measure)["data"]["result"]
        assert _has_data(result) and {s["metric"]["shard"] for s in result} == {STREAMING_SHARD}, (alert, result)


def test_prefill_and_request_alert_measures_return_data_for_both_shards(traffic):
    """The prefill and shard-queue alerts compare a measure with a threshold: over real traffic the measure alone
    returns data for every shard (and the prefill one is the max over each shard's ranks)."""
    rules = {r["alert"]: r["expr"] for r in yaml.safe_load(generate.RULES.read_text())["groups"][0]["rules"]}
    for alert, measure in (("KimiservePrefillPassSlow", generate.GROUP_PREFILL_PASS_P99),
                           ("KimiserveShardQueueWaitHigh", generate.SHARD_QUEUE_P99)):
        assert rules[alert].startswith(f"{measure} > "), (alert, rules[alert])
        result = api(traffic.prometheus, "/api/v1/query", query=measure)["data"]["result"]
        assert _has_data(result) and {s["metric"]["shard"] for s in result} == {"shard-0", "shard-1"}, (alert, result)


def test_every_alert_rule_evaluates_without_error(traffic):
    rules = yaml.safe_load(generate.RULES.read_text())["groups"][0]["rules"]
    for rule in rules:
        reply = api(traffic.prometheus, "/api/v1/query", query=rule["expr"])
        assert reply["status"] == "success", (rule["alert"], reply)
    end = time.monotonic() + 30
    while True:
        groups = api(traffic.prometheus, "/api/v1/rules")["data"]["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        evaluated = {n: r for n, r in loaded.items() if not r.get("lastEvaluation", "").startswith("0001")}
        if len(evaluated) == len(rules) or time.monotonic() > end:
            break
        time.sleep(1)
    assert set(loaded) == {r["alert"] for r in rules}
    assert {n: r["health"] for n, r in evaluated.items()} == {r["alert"]: "ok" for r in rules}, loaded
    firing = [n for n, r in loaded.items() if r["state"] == "firing"]
    assert not firing, f"alerts firing on a healthy stack: {firing}"


def test_api_key_is_required_and_never_logged(traffic):
    with traffic.router_channel() as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for metadata in ((), authed(WRONG_KEY), (("authorization", "Basic abc"),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(router_pb2.GenerateRequest(text="hi"), metadata=metadata, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
            with pytest.raises(grpc.RpcError) as e:
                stub.ListModels(router_pb2.ListModelsRequest(), metadata=metadata, timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.ListModels(router_pb2.ListModelsRequest(), metadata=authed(), timeout=30).models
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # health stays open for probes / LBs
    log = traffic.router.log.read_text()
    assert "request refused: wrong API key" in log and "request refused: missing API key" in log
    assert GOOD_KEY not in log and WRONG_KEY not in log and "ks-good" not in log and "ks-wrong" not in log


def test_public_port_is_tls_only(traffic):
    with grpc.insecure_channel(f"127.0.0.1:{traffic.router.port('grpc')}") as channel:
        with pytest.raises(grpc.RpcError) as e:
            router_pb2_grpc.RouterStub(channel).ListModels(router_pb2.ListModelsRequest(), metadata=authed(),
                                                           timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # A client trusting another CA refuses the router's certificate.
    rogue = grpc.ssl_channel_credentials((traffic.etc / "rogue" / "ca.crt").read_bytes())
    with grpc.secure_channel(f"127.0.0.1:{traffic.router.port('grpc')}", rogue) as channel:
        with pytest.raises(grpc.RpcError) as e:
            router_pb2_grpc.RouterStub(channel).ListModels(router_pb2.ListModelsRequest(), metadata=authed(),
                                                           timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("name", ["tokenizer", "shard-0", "shard-1"])
def test_internal_services_require_the_routers_client_certificate(traffic, name):
    p = traffic.procs[name]
    port = p.port("grpc")
    assert probe_ok(p.host, port, traffic.internal_creds())  # the router's certificate: accepted
    assert not probe_ok(p.host, port, traffic.internal_creds(None))  # TLS without a client certificate
    assert not probe_ok(p.host, port, traffic.internal_creds("rogue"))  # a certificate from another CA
    assert not probe_ok(p.host, port)  # plaintext


@pytest.mark.parametrize("name", ["tokenizer", "shard-0"])
def test_internal_services_require_the_internal_token_beside_the_certificate(traffic, name):
    """The router's certificate alone is not enough: without the chart's token a call is UNAUTHENTICATED."""
    p = traffic.procs[name]
    options = [("grpc.ssl_target_name_override", INTERNAL_NAME)]
    with grpc.secure_channel(f"{p.host}:{p.port('grpc')}", traffic.internal_creds(), options=options) as channel:
        if name == "tokenizer":
            call = tokenizer_pb2_grpc.TokenizerStub(channel).Info
            request = tokenizer_pb2.TokenizerInfoRequest()
        else:
            call, request = shard_pb2_grpc.ShardStub(channel).Info, shard_pb2.ShardInfoRequest()
        with pytest.raises(grpc.RpcError) as e:
            call(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        assert call(request, metadata=((internal_auth.TOKEN_HEADER, traffic.internal_token.decode()),), timeout=10)


def test_discovery_drains_a_real_shard_that_leaves(traffic):
    """In-process discovery over the running (mTLS) shards: both join; one leaves while serving a short and a long
    sequence: the short one finishes during the drain, the long one fails UNAVAILABLE when discovery stops and ends
    the drain. The drain timeout is far longer than the test so no step races the clock (the timeout itself is
    checked in test_discovery_security_units)."""
    upstream = security.UpstreamTls(traffic.etc / "internal-tls" / "ca.crt", traffic.etc / "internal-tls" / "tls.crt",
                                    traffic.etc / "internal-tls" / "tls.key", INTERNAL_NAME)
    port = traffic.procs["shard-0"].port("grpc")
    addresses = {f"{h}:{port}" for h in SHARD_HOSTS}

    async def main():
        shards: list[ShardClient] = []
        resolve = static_resolver(addresses)
        found = {"now": set(addresses)}

        async def dynamic():
            return set(found["now"])

        d = ShardDiscovery(shards, [dynamic], remove_after=1, drain_timeout_s=120,
                           make_client=lambda a: ShardClient(a, channel=security.aio_channel(
                               a, upstream, interceptors=internal_auth.client_interceptors(traffic.internal_token))))
        assert await resolve() == addresses
        await d.refresh()
        end = time.monotonic() + 30
        while not all(c.view.healthy for c in shards):
            assert time.monotonic() < end, "shards did not come into rotation"
            await asyncio.sleep(0.1)
        leaving = next(c for c in shards if c.address.startswith(SHARD_HOSTS[1]))

        def submit(rid, n):
            return leaving.submit(shard_pb2.ShardRequest.Submit(
                request_id=rid, prompt_token_ids=[5, 6, 7], max_tokens=n,
                sampling=common_pb2.SamplingParams(temperature=0, ignore_eos=True)))

        short, long = await submit("drain-short", 3), await submit("drain-long", 500)  # ~3 tokens/10 ms
        found["now"] = {f"{SHARD_HOSTS[0]}:{port}"}  # SHARD_HOSTS[1] left the headless Service
        await d.refresh()
        assert [c.address for c in shards] == [f"{SHARD_HOSTS[0]}:{port}"]

        async def last(queue):
            while True:
                event = await asyncio.wait_for(queue.get(), 30)
                if isinstance(event, Exception) or event.WhichOneof("kind") == "finished":
                    return event

        short_end = await last(short)
        assert not isinstance(short_end, Exception) and short_end.finished.usage.completion_tokens == 3
        await d.stop()  # the long sequence (497 tokens to go) is still in the drain: it fails now
        long_end = await last(long)
        assert isinstance(long_end, ShardUnavailable) and "removed by shard discovery" in str(long_end)
        for c in shards:
            await c.close()

    asyncio.run(main())
    # The shard itself is fine: the router in the stack still uses it.
    with traffic.router_channel() as channel:
        assert generate_one(router_pb2_grpc.RouterStub(channel), "still here", 3).usage.completion_tokens == 3


def test_api_keys_rotate_without_restart(traffic):
    path = traffic.secret_paths["api-keys"]
    new_key = f"ks-new-{secrets.token_hex(8)}"
    original = path.read_text()
    try:
        path.write_text(f"{new_key}\n")
        with traffic.router_channel() as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            end = time.monotonic() + 15
            while True:
                try:
                    stub.ListModels(router_pb2.ListModelsRequest(), metadata=authed(new_key), timeout=10)
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAUTHENTICATED and time.monotonic() < end
                    time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as e:
                stub.ListModels(router_pb2.ListModelsRequest(), metadata=authed(GOOD_KEY), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        path.write_text(original)
    assert new_key not in traffic.router.log.read_text()
