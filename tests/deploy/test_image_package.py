"""What the Docker image installs, without a Docker daemon: a wheel built from exactly the files the Dockerfile's build
stage copies, installed into a fresh target as `pip install .` installs it there. The weight-streaming engine's C++
source must be inside, `native.py` must find it in the install (not in a checkout), and the Dockerfile's prebuild
must give a build the runtime loads without writing anything (the chart's root filesystem is read-only)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NATIVE_FILES = ("native/__init__.py", "native/build.py", "native/stream_engine.cpp")


def build_stage_copies() -> list[str]:
    """The sources of the build stage's `COPY src dst` lines (the image's whole build context)."""
    lines = (REPO / "Dockerfile").read_text().split("\nFROM ")[1].splitlines()  # the build stage
    return [src for line in lines if line.startswith("COPY ") and "--from" not in line for src in line.split()[1:-1]]


def installed_python(target: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """python ARGS with `target` as the only source of kimiserve's packages (no checkout on the path, cwd outside)."""
    run_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)} | (env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=run_env,
                          cwd=target.parent)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the target it is installed into)."""
    root = tmp_path_factory.mktemp("image")
    context = root / "context"
    context.mkdir()
    for src in build_stage_copies():
        if (REPO / src).is_dir():
            shutil.copytree(REPO / src, context / src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(REPO / src, context / src)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", str(context), "--no-deps", "--no-build-isolation", "-w", str(root / "dist")],
                   check=True, capture_output=True, timeout=600)
    wheel = next((root / "dist").glob("kimiserve-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(root / "site"), str(wheel)], check=True,
                   capture_output=True, timeout=600)
    return wheel, root / "site"


def test_the_wheel_carries_the_native_sources(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(NATIVE_FILES) <= names, sorted(n for n in names if "native" in n)


def test_native_finds_its_source_in_the_install(installed):
    _, site = installed
    out = installed_python(site, "-c", "from shard_svc.weight_streaming.native import native_source; "
                                           "print(native_source())")
    assert out.returncode == 0, out.stderr[-3000:]
    found = Path(out.stdout.strip())
    assert found == site / NATIVE_FILES[2] and found.read_bytes() == (REPO / NATIVE_FILES[2]).read_bytes()


def test_up_in_an_install_asks_for_a_model(installed):
    """models/ belongs to a checkout, not to the image (the chart passes --model): `up` there says so in one line."""
    _, site = installed
    out = installed_python(site, "-m", "launcher.cli", "up", "--port", "0", "--http-port", "0")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("kimiserve up: error: the default model") and "pass --model DIR" in line, line
    assert str(site) in line  # it looked beside the installed package


@pytest.mark.slow
def test_the_images_prebuild_loads_read_only(installed, tmp_path):
    """The Dockerfile's prebuild command, run on the install; then the runtime's load writes nothing (~90 s: one
    compile of the engine without ninja, as in the image)."""
    _, site = installed
    dockerfile = (REPO / "Dockerfile").read_text()
    assert dockerfile.count("KIMISERVE_NATIVE_CACHE=/opt/kimiserve/native") == 2  # both stages: one cache
    assert "python -m native.build --direct" in dockerfile
    cache = tmp_path / "native"
    env = {"KIMISERVE_NATIVE_CACHE": str(cache)}
    built = installed_python(site, "-m", "native.build", "--direct", env=env)
    assert built.returncode == 0 and "direct build" in built.stdout, built.stderr[-3000:]
    assert "Warning" not in built.stderr, built.stderr[-3000:]
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in cache.rglob("*")}
    for p in [cache, *cache.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    try:
        # ninja is on this machine (the test extra) but not in the image: the prebuilt direct build is used anyway.
        loaded = installed_python(site, "-c", "from shard_svc.weight_streaming.native import load_native; "
                                              "m = load_native('cpu'); m.StreamEngine(1, 1 << 20, 'cpu'); "
                                              "print(m.BUILD_DIR, m.BUILT_WITH)", env=env)
    finally:
        for p in [cache, *cache.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split() == [str(next(cache.iterdir())), "direct"]
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in cache.rglob("*")} == before
