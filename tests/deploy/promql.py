"""Metric names in PromQL expressions, and the names the services export (from their metrics.py declarations)."""

from __future__ import annotations

import re

KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
            "group_right", "inf", "nan", "atan2"}
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("", "_count", "_sum", "_created"), "info": ("_info",), "untyped": ("",)}


def metric_names(expr: str) -> set[str]:
    """Every metric name an expression selects (label_values(metric, label) included)."""
    names = set(re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)", expr))
    if names:
        return names
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)  # grouping labels
    s = re.sub(r"\[[^\]]*\]", "", s)  # range selectors
    for m in re.finditer(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", s):
        if m.group(2) is None and m.group(1).lower() not in KEYWORDS:
            names.add(m.group(1))
    return names


def exported_names() -> dict[str, str]:
    """Series name -> declaring service, for every metric declared in the services' metrics.py files."""
    from prometheus_client import REGISTRY, CollectorRegistry

    import tokenizer_svc.metrics  # noqa: F401 - declares on the default registry
    from router.batch.metrics import BatchMetrics
    from router.metrics import RouterMetrics
    from shard_svc.server.metrics import ShardMetrics
    from shard_svc.weight_streaming.metrics import StreamingMetrics

    router = RouterMetrics()
    BatchMetrics(router.registry)
    shard = ShardMetrics("s")
    StreamingMetrics(shard.registry)  # weight streaming and host KV: on the shard's registry (shard_svc/server/main.py)
    registries = {"router": router.registry, "shard": shard.registry, "tokenizer": REGISTRY}
    out: dict[str, str] = {}
    for service, registry in registries.items():
        assert isinstance(registry, CollectorRegistry)
        for family in registry.collect():
            if family.name.startswith("kimiserve_"):
                for suffix in SUFFIXES[family.type]:
                    out[family.name + suffix] = service
    return out
