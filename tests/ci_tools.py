"""The suite's non-Python tools, got through scripts/ci_tools.sh (package registries only). A test that cannot get
its tool FAILS with the command to run; nothing is skipped."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CI_TOOLS = REPO / "scripts" / "ci_tools.sh"


def install(tool: str) -> None:
    proc = subprocess.run(["bash", str(CI_TOOLS), tool], cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"could not install {tool} with `bash scripts/ci_tools.sh {tool}` (exit {proc.returncode}):\n"
                    f"{proc.stdout}\n{proc.stderr}")


def debian_tool(name: str, package: str) -> str:
    """The path of `name`, installing Debian's `package` first when it is missing and we are root (as CI runs)."""
    path = shutil.which(name)
    if path is None and os.geteuid() == 0:
        install(package)
        path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: run `sudo bash scripts/ci_tools.sh {package}` (Debian package {package})")
    return path
