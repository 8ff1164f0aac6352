"""Shared fixtures: the tiny Kimi tokenizer written once per session, in both on-disk formats."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kimiserve.tokenizer_files.loading import LoadedTokenizer, load_tokenizer
from kimiserve.tokenizer_files.tiny import write_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json + tiktoken.model + tokenizer_config.json + a config.json naming the model type."""
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    assert write_tiny_tokenizer(out) == 768
    (out / "config.json").write_text('{"model_type": "kimi_k3"}\n')
    return out


@pytest.fixture(scope="session")
def tiktoken_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tokenizer with tiktoken.model + tokenizer_config.json only, so the conversion path loads."""
    out = tmp_path_factory.mktemp("tiny_tiktoken")
    for name in ("tiktoken.model", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def tok(tiny_dir: Path) -> LoadedTokenizer:
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def tik(tiktoken_dir: Path) -> LoadedTokenizer:
    return load_tokenizer(tiktoken_dir)
