"""constraints.txt pins every package `make` installs, inside pyproject.toml's ranges: a dependency added to
pyproject.toml without `make lock` would install whatever is newest on a fresh clone, the hole the file closes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]

if sys.version_info < (3, 11):
    pytest.skip("tomllib is Python 3.11's", allow_module_level=True)
import tomllib  # noqa: E402 - after the version check


def pins() -> dict[str, str]:
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version
    return out


def requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def test_every_dependency_is_pinned_within_its_range():
    pinned = pins()
    unpinned, outside = [], []
    for req in requirements():
        name = canonicalize_name(req.name)
        if name == "torch" or (req.marker and not req.marker.evaluate()):
            continue  # torch: the Makefile installs the CPU build itself; a marker false here installs nothing
        if name not in pinned:
            unpinned.append(str(req))
        elif not req.specifier.contains(pinned[name], prereleases=True):
            outside.append(f"{req} but constraints.txt pins {pinned[name]}")
    assert not unpinned, f"not in constraints.txt (run `make lock`): {unpinned}"
    assert not outside, f"pinned outside pyproject.toml's range (run `make lock`): {outside}"


def test_torch_is_left_to_the_makefile():
    assert "torch" not in pins(), "constraints.txt must not pin torch: the Makefile installs the local CPU build"
    assert "torch==2.13.0" in (REPO / "Makefile").read_text()
