"""Settings and fixtures for the whole suite.

One torch thread per test process and per process it starts (OMP_NUM_THREADS, inherited): the tests run tiny
tensors, where a second intra-op thread buys nothing, and on a busy 2-core machine (CI running a stack beside the
test process, or xdist workers) OpenMP threads spinning for a core they do not get made each small op ~50x slower
(a 93-layer tiny K3 forward: 92 s with 2 threads, 1.5 s with 1, measured with the machine loaded). Shards already
default to --cpu-threads 1.

The tiny checkpoints (with the tiny tokenizer) that the served stacks load are built once per session (per xdist
worker) instead of once per folder or module; the processes only read them. A test that damages or edits a model
copies it first (shutil.copytree). tests/model/conftest.py has checkpoints of its own (other seeds, no tokenizer)
under the same names for the loader tests; inside tests/model they win.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from kimiserve.ports import use_range

# torch reads it when first imported, in this process (after this file: no plugin here imports torch) and in every
# child. A run that sets it itself keeps its own value.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Routers started without --batch-db keep their batch store under $XDG_CACHE_HOME/kimiserve: one directory per test
# process (and the processes it starts), removed at exit, so tests neither share a store nor write the user's cache.
# The native engine's build cache stays where it was: a rebuild per test process would load the machine for nothing.
os.environ.setdefault("KIMISERVE_NATIVE_CACHE", str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kimiserve" / "native"))
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="kimiserve-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
if "torch" in sys.modules:
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Ports for the servers a test starts come from this worker's own slice of 20000-32767, below the kernel's ephemeral
# range (32768-60999): no other worker picks them and no outgoing connection takes one before its server binds it
# (kimiserve/ports.py::use_range). Seen with kernel-picked ports: a router's metrics port taken meanwhile.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
_SLICE = (32768 - 20000) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
use_range(20000 + _WORKER * _SLICE, 20000 + (_WORKER + 1) * _SLICE)


# The longest test files, longest first (seconds each took in a `make test` of three workers on a 2-core AMD EPYC
# machine, 2026-12-07: 1,306 s in all, 3,801 s of worker time; test_resilience and test_router_replicas, 164 and 77 s
# then, have since moved to the 4-layer model and left the list).
# `make test` hands whole files to its xdist workers in collection order (--dist loadfile --no-loadscope-reorder);
# starting these first keeps the run from ending on one worker still busy with a long file while the others idle.
LONGEST_FIRST = (
    "tests/trained/test_parity.py",  # 464 (the trained 93-layer K3 under the interpreter)
    "tests/kernels/test_sm90_compile.py",  # 399
    "tests/kernels/test_kda_chunk.py",  # 251
    "tests/services/test_generation.py",  # 142
    "tests/reliability/test_faults.py",  # 139
    "tests/kernels/test_mla_moe_in_model.py",  # 134
    "tests/reliability/test_failover.py",  # 130
    "tests/parallel/test_group_parity.py",  # 92
    "tests/reliability/test_up.py",  # 86
    "tests/test_cli_generate.py",  # 68
    "tests/deploy/test_image_package.py",  # 66
    "tests/services/test_choices_and_tools.py",  # 60
    "tests/test_cli.py",  # 59
    "tests/parallel/test_cli.py",  # 58
    "tests/router/batch/test_durability.py",  # 55
    "tests/services/test_prefix_boundaries.py",  # 51
    "tests/router/batch/test_run.py",  # 51
    "tests/kernels/test_short_conv.py",  # 50
    "tests/services/test_fair_prefill.py",  # 47
    "tests/kernels/test_snapshots_in_model.py",  # 46
    "tests/services/test_sampling_surface.py",  # 44
    "tests/services/test_client_security.py",  # 43
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order


@pytest.fixture(scope="session")
def tiny_linear(tmp_path_factory) -> Path:
    """`kimiserve make-tiny kimi_linear` (4 layers, seed 0) plus its tokenizer."""
    from shard_svc.make_tiny import make_tiny

    return make_tiny("kimi_linear", tmp_path_factory.mktemp("shared_models") / "tiny-linear", seed=0)


@pytest.fixture(scope="session")
def tiny_k3(tmp_path_factory) -> Path:
    """`kimiserve make-tiny kimi_k3`: the full 93-layer topology, MXFP4 experts, four shards, seed 0, tokenizer."""
    from shard_svc.make_tiny import make_tiny

    return make_tiny("kimi_k3", tmp_path_factory.mktemp("shared_models") / "tiny-k3", seed=0)
