"""Fixtures of the deploy tests: the helm, promtool and prometheus binaries, chart rendering, test certificates.

The tools come from package registries only (scripts/ci_tools.sh): helm from an npm package, promtool and prometheus
from Debian's `prometheus`. A fixture that cannot get its tool FAILS with the command to run; nothing is skipped.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.ci_tools import debian_tool, install

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kimiserve"


@pytest.fixture(scope="session")
def helm_bin() -> str:
    local = REPO / ".cache" / "tools" / "bin" / "helm"
    if not local.exists():
        install("helm")
    if not local.exists():
        pytest.fail(f"scripts/ci_tools.sh helm ran but {local} does not exist")
    return str(local)


@pytest.fixture(scope="session")
def promtool_bin() -> str:
    return debian_tool("promtool", "prometheus")


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    return debian_tool("prometheus", "prometheus")


def helm_template(helm: str, *args: str, release: str = "rel", namespace: str = "ml") -> list[dict]:
    """`helm template` of the chart; returns the rendered documents (raises AssertionError with helm's stderr)."""
    proc = subprocess.run([helm, "template", release, str(CHART), "--namespace", namespace, *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"helm template {' '.join(args)} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def find(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(hits) == 1, f"expected one {kind} *{name_suffix}, got {[d['metadata']['name'] for d in hits]}"
    return hits[0]
