"""Weight-streaming tests on the CPU build of the native engine (built once per session into the user cache)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shard_svc.streaming.native import load_native

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def native():
    return load_native(CPU)


@pytest.fixture(scope="session")
def tiny_k3(tmp_path_factory) -> Path:
    """The tiny 93-layer K3 checkpoint (MXFP4 experts, four shards, `language_model.` names) and tokenizer."""
    from shard_svc.make_tiny import make_tiny

    return make_tiny("kimi_k3", tmp_path_factory.mktemp("k3") / "m", seed=0)


def host_tensors(native_engine, values: dict[str, torch.Tensor]) -> dict[str, int]:
    """Registers each tensor (name -> tensor) and returns name -> host id."""
    return {name: native_engine.add_host(t, name) for name, t in values.items()}
