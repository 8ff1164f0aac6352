"""Weight-streaming tests on the CPU build of the native engine (built once per session into the user cache)."""

from __future__ import annotations

import pytest
import torch

from shard_svc.weight_streaming.native import load_native

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def native():
    return load_native(CPU)


def host_tensors(native_engine, values: dict[str, torch.Tensor]) -> dict[str, int]:
    """Registers each tensor (name -> tensor) and returns name -> host id."""
    return {name: native_engine.add_host(t, name) for name, t in values.items()}
