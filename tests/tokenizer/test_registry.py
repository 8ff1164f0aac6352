"""The model_type registry: a broken plug-in warns by name and the others still register
(docs/lessons.md#a-broken-plug-in-stays-local)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kimiserve.tokenizer_files.errors import TokenizerLoadError
from tokenizer_svc.errors import UnsupportedModelType
from tokenizer_svc.registry import TOKENIZER_MODULES, build_registry, load_for_model, model_type_of


def test_kimi_model_types_share_the_kimi_loader() -> None:
    registry = build_registry()
    assert {"kimi_linear", "kimi_k3"} <= set(registry)
    assert registry["kimi_linear"] is registry["kimi_k3"]
    assert TOKENIZER_MODULES["kimi_k3"] == "kimiserve.tokenizer_files.loading"


def test_broken_module_warns_and_the_rest_register(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "kimiserve_test_broken_tokenizer.py").write_text("raise RuntimeError('plug-in exploded on import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = {"kimi_k3": "kimiserve.tokenizer_files.loading", "broken_type": "kimiserve_test_broken_tokenizer"}
    with caplog.at_level(logging.WARNING, logger="tokenizer_svc.registry"):
        registry = build_registry(modules)
    assert set(registry) == {"kimi_k3"}
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "kimiserve_test_broken_tokenizer" in record.getMessage()
    assert "plug-in exploded on import" in record.getMessage()
    assert record.model_types == ["broken_type"]  # type: ignore[attr-defined]


def test_missing_module_also_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenizer_svc.registry"):
        registry = build_registry({"a": "kimiserve.tokenizer_files.loading", "b": "no_such_module_kimiserve"})
    assert set(registry) == {"a"}
    assert "no_such_module_kimiserve" in caplog.text


def test_load_for_model_reads_model_type(tiny_dir: Path, tmp_path: Path) -> None:
    assert model_type_of(tiny_dir) == "kimi_k3"
    model_type, tok = load_for_model(tiny_dir)
    assert (model_type, tok.vocab_size) == ("kimi_k3", 768)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UnsupportedModelType, match=r"'llama'.*registered: \["):
        load_for_model(tmp_path)
    with pytest.raises(TokenizerLoadError, match="config.json"):
        model_type_of(tmp_path / "nowhere")
