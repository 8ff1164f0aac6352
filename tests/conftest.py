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

import os
import sys
from pathlib import Path

import pytest

# torch reads it when first imported, in this process (after this file: no plugin here imports torch) and in every
# child. A run that sets it itself keeps its own value.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
