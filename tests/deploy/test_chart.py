"""The Helm chart checked with real tools: helm lint / template (default and non-default values), Kubernetes schemas
(kubernetes-validate, offline), promtool on the alert rules, and cross-checks of how the rendered objects wire up
(selectors, ports, probes, the router's discovery target). Generated files (values.schema.json, the dashboard, the
rules file) must be fresh, and no dashboard or alert expression may name a metric the services do not export."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import CHART, find, helm_template
from tests.deploy.promql import exported_names, metric_names

K8S_VERSION = "1.33.0"  # within Chart.yaml's kubeVersion; kubernetes-validate ships its schemas offline
NON_DEFAULT = {
    "model.source": "objectStore", "model.name": "tiny", "model.subPath": "ckpt",
    "security.tls.enabled": "true", "security.apiKeys.enabled": "true", "security.mtls.enabled": "true",
    "router.autoscaling.enabled": "true", "tokenizer.autoscaling.enabled": "true",
    "shard.gpus": "0", "shard.maxModelLen": "4096", "shard.replicas": "3",
    "monitoring.serviceMonitors.enabled": "true", "monitoring.serviceMonitors.labels.release": "prom",
    "monitoring.prometheusRule.enabled": "true", "monitoring.dashboards.annotations.grafana_folder": "LLM",
    "image.pullSecrets[0]": "regcred", "router.extraArgs[0]": "--log-level=DEBUG",
    "shard.weights.mode": "stream", "shard.weights.prefetchDepth": "3", "shard.weights.slots": "5",
    "shard.weights.pinnedMemoryGb": "40", "shard.hostKvGb": "16",  # 56 GiB, within the default 64Gi limit
    "tracing.otlpEndpoint": "http://otel-collector.obs:4317",
}
# The weight streaming and host KV flags; none is rendered at the defaults.
STREAMING_FLAGS = ("--weights=", "--prefetch-depth=", "--weight-slots=", "--pinned-memory-gb=", "--host-kv-gb=")
VARIANTS = {
    "default": [],
    "non-default": [a for k, v in NON_DEFAULT.items() for a in ("--set-string" if k.endswith("grafana_folder")
                                                                  else "--set", f"{k}={v}")],
    "hostPath-pdb-off": ["--set", "model.source=hostPath", "--set", "router.pdb.enabled=false",
                         "--set", "shard.pdb.enabled=false", "--set", "tokenizer.pdb.enabled=false",
                         "--set", "monitoring.dashboards.enabled=false"],
}
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load(CHART / "dashboards" / "generate.py")
schema_gen = _load(CHART / "schema.py")


# -- generated files ------------------------------------------------------------------------------------------------
def test_generated_files_are_fresh():
    assert (CHART / "values.schema.json").read_text() == schema_gen.generate(), \
        "values.schema.json is stale: run python helm/kimiserve/schema.py"
    assert generate.DASHBOARD.read_text() == generate.dashboard_json(), \
        "dashboards/kimiserve.json is stale: run python helm/kimiserve/dashboards/generate.py"
    assert generate.RULES.read_text() == generate.rules_yaml(), \
        "rules/kimiserve-alerts.yaml is stale: run python helm/kimiserve/dashboards/generate.py"


def test_every_values_key_is_documented_and_in_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(v, s, path):
        if s.get("additionalProperties") is False:
            assert set(v) == set(s["properties"]), path
            for k in v:
                walk(v[k], s["properties"][k], f"{path}.{k}")
        else:
            assert s.get("description"), f"{path} has no description"

    walk(values, schema, "values")


def test_metric_name_parser_finds_every_selector():
    assert metric_names('sum by (shard) (rate(foo_total{a="b, c"}[5m])) / on (x) group_left bar_x > 2') == \
        {"foo_total", "bar_x"}
    assert metric_names('label_values(kimiserve_x{namespace=~"$namespace"}, model)') == {"kimiserve_x"}


def test_dashboard_and_alerts_name_only_exported_metrics():
    exported = exported_names()
    dash = json.loads(generate.DASHBOARD.read_text())
    exprs = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [(v["name"], v["query"]["query"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    rules = yaml.safe_load(generate.RULES.read_text())["groups"][0]["rules"]
    exprs += [(r["alert"], r["expr"]) for r in rules]
    problems = [(where, sorted(metric_names(e) - exported.keys())) for where, e in exprs
                if metric_names(e) - exported.keys()]
    assert not problems, f"expressions naming metrics no service exports: {problems}"
    assert all(metric_names(e) for _, e in exprs)


def test_dashboard_covers_the_issue_and_is_templated():
    dash = json.loads(generate.DASHBOARD.read_text())
    titles = {p["title"] for p in dash["panels"]}
    for wanted in ("Request rate by status", "Time to first token", "Time per output token", "End-to-end latency",
                   "Prefill pass duration per shard", "Prefill pass p99, max over shards", "Decode step time per shard",
                   "Tokens per second", "Queue depth", "State-slot usage per shard", "KV-block usage per shard",
                   "Shard health (as routers see it)", "Batch jobs by status",
                   "Streamed weight bytes per second", "Copy, compute and stall per pass (mean)",
                   "Stall share of copy time", "Weight slot occupancy", "Layers fetched ahead per second",
                   "Host KV pages", "KV pages offloaded and restored per second",
                   "Where a request's time went (mean)", "Time to first token per shard",
                   "Time per output token per shard", "Shard queue wait per shard",
                   "Prefill time per request, per shard", "End-to-end per shard", "Inter-token latency",
                   "Prompt and generation length", "Finish reasons", "Prefill pass p99 per rank",
                   "Tokens and sequences per prefill pass (mean)", "Chunks per pass and tokens per chunk (mean)",
                   "Prompt length per shard"):
        assert wanted in titles
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows[:3] == ["Requests", "Request latency", "Prefill"]
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "namespace", "model"}
    for p in dash["panels"]:
        for t in p.get("targets", []):
            assert 'namespace=~"$namespace"' in t["expr"] and 'model=~"$model"' in t["expr"], t["expr"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


# -- helm ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint(helm_bin, variant):
    proc = subprocess.run([helm_bin, "lint", "--strict", str(CHART), *VARIANTS[variant]], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rendered_manifests_pass_kubernetes_schemas(helm_bin, variant):
    docs = helm_template(helm_bin, *VARIANTS[variant])
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue  # no upstream schema offline; checked structurally below
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 2 and kinds.count("StatefulSet") == 1 and kinds.count("Service") == 3


@pytest.mark.parametrize("bad, message", [
    (["--set", "shard.dtype=fp8"], "/shard/dtype"),
    (["--set", "router.nosuchkey=1"], "nosuchkey"),
    (["--set", "router.port=70000"], "/router/port"),
    (["--set", "model.source=s3"], "/model/source"),
    (["--set", "image.tag=latest"], "latest"),
    (["--set", "shard.tp=2", "--set", "shard.gpus=4"], "max(shard.tp, shard.ep)"),
    # weight streaming and host KV offload: what the shard refuses at start (shard_svc/server/main.py, the streamer)
    (["--set", "shard.weights.mode=stream", "--set", "shard.tp=2", "--set", "shard.gpus=2"],
     "shard.weights.mode=stream with shard.tp=2, shard.ep=1: weight streaming runs in one process"),
    (["--set", "shard.hostKvGb=8", "--set", "shard.ep=2", "--set", "shard.gpus=2"],
     "shard.hostKvGb=8 with shard.tp=1, shard.ep=2: host KV offload runs in one process"),
    (["--set", "shard.weights.slots=2"], "shard.weights.slots=2: the ring needs at least prefetch depth + 1 = 3"),
    (["--set", "shard.weights.mode=stream", "--set", "shard.weights.prefetchDepth=4", "--set",
      "shard.weights.slots=4"], "shard.weights.slots=4: the ring needs at least prefetch depth + 1 = 5"),
    # ... what it would silently ignore: streaming settings where no weight streams
    (["--set", "shard.weights.mode=resident", "--set", "shard.weights.prefetchDepth=3"],
     "no weight can stream: shard.weights.mode is resident"),
    (["--set", "shard.tp=2", "--set", "shard.gpus=2", "--set", "shard.weights.pinnedMemoryGb=8"],
     "no weight can stream: a shard group (shard.tp=2, shard.ep=1) loads its weights resident"),
    (["--set", "shard.gpus=0", "--set", "shard.weights.slots=4"],
     "shard.weights.mode=auto never streams on the CPU (shard.gpus=0)"),
    # ... and pinned host memory beyond the container's memory limit (64Gi by default)
    (["--set", "shard.weights.pinnedMemoryGb=60", "--set", "shard.hostKvGb=4"],
     "shard.weights.pinnedMemoryGb (60) + shard.hostKvGb (4) = 64 GiB of host memory for streamed weights and KV "
     "pages does not fit shard.resources.limits.memory (64Gi = 64.00 GiB)"),
    (["--set", "shard.hostKvGb=60", "--set", "shard.resources.limits.memory=64G"],
     "does not fit shard.resources.limits.memory (64G = 59.60 GiB)"),
    (["--set", "shard.hostKvGb=1", "--set", "shard.resources.limits.memory=64gib"],
     'shard.resources.limits.memory "64gib": not a memory quantity this chart reads'),
    (["--set", "shard.weights.mode=hybrid"], "/shard/weights/mode"),
    (["--set", "shard.weights.prefetchDepth=-1"], "/shard/weights/prefetchDepth"),
    (["--set", "shard.weights.nosuchkey=1"], "nosuchkey"),
    (["--set", "shard.hostKvGb=1.5"], "/shard/hostKvGb"),  # --set passes fractions as strings (values.yaml says so)
    (["--set", "router.http.port=0"], "/router/http/port"),
    (["--set", "router.http.maxBodyBytes=0"], "/router/http/maxBodyBytes"),
    (["--set", "router.http.tls=true"], "at '/router/http': additional properties 'tls' not allowed"),
    (["--set", "security.internalToken.enabled=false"],
     "security.internalToken.enabled=false with security.mtls.enabled=false leaves the tokenizer and shards open"),
])
def test_bad_values_are_refused(helm_bin, bad, message):
    proc = subprocess.run([helm_bin, "template", "rel", str(CHART), *bad], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_shard_group_runs_as_one_pod_with_n_gpus(helm_bin):
    docs = helm_template(helm_bin, "--set", "shard.tp=2", "--set", "shard.ep=4", "--set", "shard.gpus=4")
    (shard,) = _containers(find(docs, "StatefulSet", "-shard"))
    assert shard["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert {"--tp=2", "--ep=4", "--group-timeout=60"} <= set(shard["args"])
    (single,) = _containers(find(helm_template(helm_bin), "StatefulSet", "-shard"))
    assert not any(a.startswith(("--tp=", "--ep=")) for a in single["args"])


def _shard_args(helm_bin, *values: str) -> list[str]:
    (shard,) = _containers(find(helm_template(helm_bin, *values), "StatefulSet", "-shard"))
    return shard["args"]


def test_streaming_values_render_into_flags_the_shard_parses(helm_bin):
    """Each value becomes its flag only when set, and the rendered command line parses with the shard's own argument
    parser into the intended configuration (fractions through --set-json, as values.yaml documents)."""
    import argparse

    from shard_svc.server.main import add_args, config_from_args

    def parsed(args):
        assert args[0] == "shard"
        p = argparse.ArgumentParser()
        add_args(p)
        return config_from_args(p.parse_args(args[1:])).engine  # the EngineOptions build_engine takes

    default = parsed(_shard_args(helm_bin))
    assert (default.weights.mode, default.weights.prefetch_depth, default.weights.num_slots,
            default.weights.pinned_memory_gb, default.config.host_kv_bytes) == ("auto", 2, None, None, 0)
    args = _shard_args(helm_bin, "--set", "shard.weights.mode=stream", "--set", "shard.weights.prefetchDepth=3",
                       "--set", "shard.weights.slots=5", "--set-json", "shard.weights.pinnedMemoryGb=40.5",
                       "--set-json", "shard.hostKvGb=1.5")
    assert [a for a in args if a.startswith(STREAMING_FLAGS)] == [
        "--weights=stream", "--prefetch-depth=3", "--weight-slots=5", "--pinned-memory-gb=40.5", "--host-kv-gb=1.5"]
    cfg = parsed(args)
    assert (cfg.weights.mode, cfg.weights.prefetch_depth, cfg.weights.num_slots, cfg.weights.pinned_memory_gb,
            cfg.config.host_kv_bytes) == ("stream", 3, 5, 40.5, int(1.5 * (1 << 30)))
    # one value at a time: only its own flag; auto on a GPU may stream, so its ring settings are passed
    assert [a for a in _shard_args(helm_bin, "--set", "shard.weights.slots=4") if a.startswith(STREAMING_FLAGS)] == \
        ["--weight-slots=4"]
    assert [a for a in _shard_args(helm_bin, "--set", "shard.weights.mode=resident")
            if a.startswith(STREAMING_FLAGS)] == ["--weights=resident"]
    # host KV alone, on the CPU too; the memory limit is checked only where one is set
    args = _shard_args(helm_bin, "--set", "shard.gpus=0", "--set", "shard.hostKvGb=100",
                       "--set", "shard.resources.limits=null")
    assert [a for a in args if a.startswith(STREAMING_FLAGS)] == ["--host-kv-gb=100"]
    assert parsed(args).config.host_kv_bytes == 100 << 30
    assert "--pinned-memory-gb=63" in _shard_args(helm_bin, "--set", "shard.weights.pinnedMemoryGb=63")  # < 64Gi


def test_tracing_values_set_the_otel_environment_the_services_read(helm_bin):
    """Off by default (no OTEL_* variable at all); with tracing.otlpEndpoint every container gets the standard
    variables, and they switch kimiserve/tracing.py on with the OTLP exporter."""
    from kimiserve.tracing import exporters_wanted

    workloads = (("Deployment", "-router"), ("Deployment", "-tokenizer"), ("StatefulSet", "-shard"))

    def envs(*values):
        docs = helm_template(helm_bin, *values)
        return [{e["name"]: e.get("value") for e in _containers(find(docs, k, n))[0]["env"]} for k, n in workloads]

    assert all(not any(name.startswith("OTEL_") for name in env) for env in envs())
    extra = json.dumps([{"name": "OTEL_BSP_SCHEDULE_DELAY", "value": "500"}])
    for env in envs("--set", "tracing.otlpEndpoint=http://otel-collector.obs:4317", "--set-json", "tracing.ratio=0.25",
                    "--set-json", f"tracing.extraEnv={extra}", "--set", "model.name=tiny"):
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.obs:4317"
        assert (env["OTEL_TRACES_SAMPLER"], env["OTEL_TRACES_SAMPLER_ARG"]) == ("parentbased_traceidratio", "0.25")
        assert env["OTEL_EXPORTER_OTLP_INSECURE"] == "true" and env["OTEL_BSP_SCHEDULE_DELAY"] == "500"
        assert "kimiserve.model=tiny" in env["OTEL_RESOURCE_ATTRIBUTES"]
        assert exporters_wanted({k: v for k, v in env.items() if v is not None}) == ["otlp"]


def test_http_api_values_render_into_a_port_the_router_serves(helm_bin):
    """On by default: the router's --http-port is its container port "http", which the Service exposes under the same
    name (appProtocol https when the public port has TLS); the flags parse with the router's own parser. Off: no
    flag, no port."""
    import argparse

    from router.main import add_args, config_from_args

    def router(*values):
        docs = helm_template(helm_bin, *values)
        (container,) = _containers(find(docs, "Deployment", "-router"))
        service = find(docs, "Service", "-router")
        return container, {p["name"]: p for p in service["spec"]["ports"]}

    container, service_ports = router()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == 8000 and len(set(ports.values())) == len(ports)
    assert (service_ports["http"]["port"], service_ports["http"]["targetPort"],
            service_ports["http"]["appProtocol"]) == (8000, "http", "http")
    p = argparse.ArgumentParser()
    add_args(p)
    cfg = config_from_args(p.parse_args(container["args"][1:]))
    assert (cfg.http_port, cfg.http_max_body_bytes) == (8000, 16 << 20)

    container, service_ports = router("--set", "router.http.port=8443", "--set", "router.http.maxBodyBytes=1048576",
                                      "--set", "security.tls.enabled=true")
    assert {"--http-port=8443", "--http-max-body-bytes=1048576"} <= set(container["args"])
    assert {"name": "http", "containerPort": 8443, "protocol": "TCP"} in container["ports"]
    assert (service_ports["http"]["port"], service_ports["http"]["appProtocol"]) == (8443, "https")

    container, service_ports = router("--set", "router.http.enabled=false")
    assert not any(a.startswith("--http-") for a in container["args"])
    assert "http" not in {p["name"] for p in container["ports"]} and "http" not in service_ports


def _parsed(container: dict):
    """The container's command line through its own service's argument parser and config (refusals included)."""
    import argparse
    import importlib

    command = container["args"][0]
    module = importlib.import_module({"router": "router.main", "shard": "shard_svc.server.main",
                                      "tokenizer": "tokenizer_svc.main"}[command])
    p = argparse.ArgumentParser()
    module.add_args(p)
    return module.config_from_args(p.parse_args(container["args"][1:]))


def test_internal_token_is_generated_mounted_and_required(helm_bin):
    """On by default: one generated Secret, mounted in all three, named by --internal-token-file, which each
    service's parser takes; the tokenizer and shards listen on 0.0.0.0 and accept the configuration only because of
    it (off with mTLS off is refused at render, and by the services themselves without the explicit opt-out)."""
    import base64

    from kimiserve.internal_auth import MIN_TOKEN_CHARS, InternalAuthMissing

    docs = helm_template(helm_bin)
    secret = find(docs, "Secret", "-internal-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= MIN_TOKEN_CHARS and token.isalnum()
    assert base64.b64decode(find(helm_template(helm_bin), "Secret", "-internal-token")["data"]["token"]) != \
        token.encode()  # random per fresh render (an installed release keeps its own: `lookup`)
    path = "/etc/kimiserve/internal-token/token"
    for kind, name in (("Deployment", "-router"), ("Deployment", "-tokenizer"), ("StatefulSet", "-shard")):
        workload = find(docs, kind, name)
        (container,) = _containers(workload)
        assert f"--internal-token-file={path}" in container["args"], name
        assert {"name": "internal-token", "mountPath": "/etc/kimiserve/internal-token", "readOnly": True} in \
            container["volumeMounts"]
        volume = next(v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "internal-token")
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        assert str(_parsed(container).internal_token_file) == path
    own = helm_template(helm_bin, "--set", "security.internalToken.existingSecret=my-token")
    assert not [d for d in own if d["kind"] == "Secret"]
    volume = next(v for v in find(own, "Deployment", "-router")["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "internal-token")
    assert volume["secret"]["secretName"] == "my-token"
    # Off, with mTLS: the client certificate authenticates the router; no token, no opt-out.
    mtls = helm_template(helm_bin, "--set", "security.internalToken.enabled=false",
                         "--set", "security.mtls.enabled=true")
    (shard,) = _containers(find(mtls, "StatefulSet", "-shard"))
    assert not any(a.startswith(("--internal-token-file", "--allow-unauthenticated")) for a in shard["args"])
    assert _parsed(shard).internal_token_file is None
    # Off, both: only with the explicit opt-out, which the services then need too.
    opened = helm_template(helm_bin, "--set", "security.internalToken.enabled=false",
                           "--set", "security.allowUnauthenticatedInternal=true")
    for kind, name in (("Deployment", "-tokenizer"), ("StatefulSet", "-shard")):
        (container,) = _containers(find(opened, kind, name))
        assert "--allow-unauthenticated" in container["args"]
        _parsed(container)
        with pytest.raises(InternalAuthMissing):
            _parsed({**container, "args": [a for a in container["args"] if a != "--allow-unauthenticated"]})


def test_http_allowed_hosts_name_the_router_service_without_api_keys(helm_bin):
    """Without API keys the HTTP API answers only its own names: localhost (port-forward) and the router Service's,
    plus router.http.allowedHosts; with keys the check is off and no flag is rendered."""
    (router,) = _containers(find(helm_template(helm_bin, "--set-json", 'router.http.allowedHosts=["llm.example.com"]'),
                                 "Deployment", "-router"))
    hosts = _parsed(router).http_allowed_hosts
    assert {"localhost", "127.0.0.1", "::1", "rel-kimiserve-router", "rel-kimiserve-router.ml.svc.cluster.local",
            "llm.example.com"} <= set(hosts)
    (router,) = _containers(find(helm_template(helm_bin, "--set-json", 'router.http.allowedHosts=["*"]'),
                                 "Deployment", "-router"))
    assert _parsed(router).http_allowed_hosts == ("*",)
    (router,) = _containers(find(helm_template(helm_bin, "--set", "security.apiKeys.enabled=true"), "Deployment",
                                 "-router"))
    assert not any(a.startswith("--http-allowed-hosts") for a in router["args"])
    assert "--http-header-timeout=10" in router["args"] and _parsed(router).http_header_timeout_s == 10


def _containers(doc):
    return doc["spec"]["template"]["spec"]["containers"]


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_objects_wire_up(helm_bin, variant):
    docs = helm_template(helm_bin, *VARIANTS[variant])
    workloads = {c: find(docs, kind, f"-{c}") for c, kind in
                 (("router", "Deployment"), ("tokenizer", "Deployment"), ("shard", "StatefulSet"))}
    services = [d for d in docs if d["kind"] == "Service"]
    for comp, w in workloads.items():
        pod_labels = w["spec"]["template"]["metadata"]["labels"]
        assert _matches(w["spec"]["selector"]["matchLabels"], pod_labels)
        (container,) = _containers(w)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["image"].rsplit(":", 1)[1] not in ("", "latest")
        assert container["resources"]["requests"], comp
        if comp == "router":
            assert f"--http-port={ports['http']}" in container["args"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"]["port"] in ports.values(), (comp, probe)
        svc = [s for s in services if _matches(s["spec"]["selector"], pod_labels)]
        assert len(svc) == 1, comp
        for sp in svc[0]["spec"]["ports"]:
            assert sp["targetPort"] in ports, (comp, sp)
        args = container["args"]
        assert f"--port={ports['grpc']}" in args and f"--metrics-port={ports['metrics']}" in args
        assert ports["grpc"] != ports["metrics"]
    shard_svc = find(docs, "Service", "-shard-headless")
    assert shard_svc["spec"]["clusterIP"] == "None"
    assert workloads["shard"]["spec"]["serviceName"] == shard_svc["metadata"]["name"]
    router_args = _containers(workloads["router"])[0]["args"]
    shard_port = _containers(workloads["shard"])[0]["ports"][0]["containerPort"]
    assert f"--shards-dns={shard_svc['metadata']['name']}.ml.svc.cluster.local:{shard_port}" in router_args
    tok_svc = find(docs, "Service", "-tokenizer")
    assert any(a.startswith(f"--tokenizer=dns:///{tok_svc['metadata']['name']}.ml.svc.") for a in router_args)
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        assert any(_matches(pdb["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
                   for w in workloads.values())
    for hpa in (d for d in docs if d["kind"] == "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert any(w["kind"] == target["kind"] and w["metadata"]["name"] == target["name"]
                   for w in workloads.values())
        assert "replicas" not in workloads["router" if "router" in target["name"] else "tokenizer"]["spec"]
    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        svc = [s for s in services if _matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert len(svc) == 1 and {p["name"] for p in svc[0]["spec"]["ports"]} >= {"metrics"}
        assert {ep["port"] for ep in sm["spec"]["endpoints"]} == {"metrics"}
        assert any(r["targetLabel"] == "model" for r in sm["spec"]["endpoints"][0]["relabelings"])


def test_defaults_run_on_gpus_and_non_defaults_on_cpu_with_security(helm_bin):
    docs = helm_template(helm_bin)
    (shard,) = _containers(find(docs, "StatefulSet", "-shard"))
    spec = find(docs, "StatefulSet", "-shard")["spec"]["template"]["spec"]
    assert shard["resources"]["limits"]["nvidia.com/gpu"] == 1 and "--device=cuda" in shard["args"]
    assert spec["tolerations"] and spec["nodeSelector"]
    assert not any(a.startswith(STREAMING_FLAGS) for a in shard["args"])  # resident by the shard's own default
    assert {"name": "shm", "mountPath": "/dev/shm"} in shard["volumeMounts"]
    assert any(v["name"] == "shm" and v["emptyDir"]["medium"] == "Memory" for v in spec["volumes"])
    assert any(v["name"] == "model" and "persistentVolumeClaim" in v for v in spec["volumes"])
    assert not any(a.startswith("--tls") for c in ("-router", "-tokenizer") for a in
                   _containers(find(docs, "Deployment", c))[0]["args"])

    docs = helm_template(helm_bin, *VARIANTS["non-default"])
    sts = find(docs, "StatefulSet", "-shard")
    (shard,) = _containers(sts)
    assert "nvidia.com/gpu" not in shard["resources"]["limits"] and "--device=cpu" in shard["args"]
    assert sts["spec"]["template"]["spec"]["initContainers"][0]["name"] == "fetch-model"
    assert "--model=/models/ckpt" in shard["args"] and "--max-model-len=4096" in shard["args"]
    assert [a for a in shard["args"] if a.startswith(STREAMING_FLAGS)] == [
        "--weights=stream", "--prefetch-depth=3", "--weight-slots=5", "--pinned-memory-gb=40", "--host-kv-gb=16"]
    (router,) = _containers(find(docs, "Deployment", "-router"))
    for flag in ("--tls-cert=", "--api-keys-file=", "--upstream-ca=", "--upstream-server-name=", "--health-port="):
        assert any(a.startswith(flag) for a in router["args"]), flag
    assert router["startupProbe"]["grpc"]["port"] == next(p["containerPort"] for p in router["ports"]
                                                          if p["name"] == "health")
    for comp in (shard, _containers(find(docs, "Deployment", "-tokenizer"))[0]):
        assert any(a.startswith("--client-ca=") for a in comp["args"])
        assert comp["livenessProbe"]["grpc"]["port"] == next(p["containerPort"] for p in comp["ports"]
                                                             if p["name"] == "health")


def test_prometheus_rules_pass_promtool_plain_and_in_the_prometheusrule(helm_bin, promtool_bin, tmp_path):
    proc = subprocess.run([promtool_bin, "check", "rules", str(generate.RULES)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    docs = helm_template(helm_bin, "--set", "monitoring.prometheusRule.enabled=true")
    rule = find(docs, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(generate.RULES.read_text())
    extracted = tmp_path / "from-chart.yaml"
    extracted.write_text(yaml.safe_dump(rule["spec"]))
    proc = subprocess.run([promtool_bin, "check", "rules", str(extracted)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alerts = {r["alert"] for r in rule["spec"]["groups"][0]["rules"]}
    assert {"KimiserveShardDown", "KimiserveNoHealthyShard", "KimiserveRouterQueueGrowing", "KimiserveTTFTHigh",
            "KimiserveErrorRatioHigh", "KimiserveStateSlotsSaturated", "KimiserveBatchStuckInTransition",
            "KimiserveWeightStreamingStalled", "KimiserveHostKVChurn"} <= alerts


def test_dashboard_configmap_is_labelled_for_grafana(helm_bin):
    docs = helm_template(helm_bin)
    cm = find(docs, "ConfigMap", "-dashboard-kimiserve")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kimiserve.json"]) == json.loads(generate.DASHBOARD.read_text())


# -- the image the chart runs ---------------------------------------------------------------------------------------
def test_dockerfile_matches_the_package_and_the_chart():
    """The Dockerfile cannot be built here (no base-image registry); what can drift is checked statically."""
    import tomllib

    from packaging.specifiers import SpecifierSet

    repo = CHART.parents[1]
    text = (repo / "Dockerfile").read_text()
    ignored = {line.strip() for line in (repo / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    copied = [line.split()[1] for line in text.splitlines() if line.startswith("COPY ") and "--from" not in line]
    for src in copied:
        assert (repo / src).exists(), f"Dockerfile copies {src}, which does not exist"
        assert src not in ignored, f".dockerignore drops {src}, which the Dockerfile copies"
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= {c.split("/")[0] for c in copied}, "a package of pyproject.toml is not copied into the image"
    torch_pin = next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ARG TORCH_VERSION="))
    torch_req = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    assert torch_pin in SpecifierSet(torch_req[len("torch"):]), (torch_pin, torch_req)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    assert f"USER {uid}:{values['podSecurityContext']['runAsGroup']}" in text
    exposed = {int(p) for line in text.splitlines() if line.startswith("EXPOSE") for p in line.split()[1:]}
    for comp in ("router", "tokenizer", "shard"):
        assert {values[comp][k] for k in ("port", "metricsPort", "healthPort")} <= exposed, comp
    assert values["router"]["http"]["port"] in exposed
    assert 'ENTRYPOINT ["kimiserve"]' in text
    assert values["image"]["tag"] == yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
