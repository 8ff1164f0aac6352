"""Tiny checkpoints written once per session by make-tiny, and helpers to damage copies of them by hand."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shard_svc.make_tiny import write_tiny_checkpoint

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="session")
def tiny_linear(tmp_path_factory) -> Path:
    """kimi_linear, 4 layers (layer 0 dense, MLA at 3), one model.safetensors."""
    return write_tiny_checkpoint("kimi_linear", tmp_path_factory.mktemp("tiny") / "kimi_linear", seed=1)


@pytest.fixture(scope="session")
def tiny_k3(tmp_path_factory) -> Path:
    """kimi_k3, the full 93-layer topology, MXFP4 experts, 4 shards behind an index."""
    return write_tiny_checkpoint("kimi_k3", tmp_path_factory.mktemp("tiny") / "kimi_k3", seed=2)


@pytest.fixture(scope="session")
def tiny_k3_small(tmp_path_factory) -> Path:
    """kimi_k3 truncated to 5 layers (MLA at 3 and 4): cheap to copy and damage."""
    return write_tiny_checkpoint("kimi_k3", tmp_path_factory.mktemp("tiny") / "kimi_k3_5", seed=3, layers=5)


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_file(path: Path, edit: Callable[[Tensors], None]) -> None:
    """Rewrite one safetensors file after `edit` changed its tensors in place (by hand, not via the loader)."""
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def file_holding(ckpt: Path, name: str) -> Path:
    """The safetensors file of `ckpt` that holds tensor `name` (searched by hand, without the index)."""
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            if name in f.keys():
                return path
    raise KeyError(name)
