"""model_type -> tokenizer loader, as a registry dict (never an if/elif chain).

Each entry names a module exposing `load_tokenizer(model_dir: Path) -> LoadedTokenizer`. Modules are imported by
name when the registry is built; one that fails to import is logged as a warning naming it and its error, and only
its model types are missing: the others still register (docs/lessons.md#a-broken-plug-in-stays-local).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from kimiserve.tokenizer_files.errors import TokenizerLoadError
from kimiserve.tokenizer_files.loading import LoadedTokenizer
from tokenizer_svc.errors import UnsupportedModelType

log = logging.getLogger(__name__)

TokenizerFactory = Callable[[Path], LoadedTokenizer]

# Every Kimi family shares the K2 tokenizer (docs/models.md#tokenizer-and-chat-format).
TOKENIZER_MODULES: dict[str, str] = {
    "kimi_k2": "kimiserve.tokenizer_files.loading",
    "kimi_linear": "kimiserve.tokenizer_files.loading",
    "kimi_k3": "kimiserve.tokenizer_files.loading",
}


def build_registry(modules: Mapping[str, str] = TOKENIZER_MODULES) -> dict[str, TokenizerFactory]:
    """Import each module once; model types whose module fails are left out, with a warning."""
    registry: dict[str, TokenizerFactory] = {}
    by_module: dict[str, list[str]] = {}
    for model_type, module_name in sorted(modules.items()):
        by_module.setdefault(module_name, []).append(model_type)
    for module_name, model_types in sorted(by_module.items()):
        try:
            factory = importlib.import_module(module_name).load_tokenizer
        except Exception as exc:  # a plug-in may fail in any way; it must not take the others down
            log.warning(
                "tokenizer module %s failed to import (%r); model types %s unavailable",
                module_name, exc, model_types,
                extra={"plugin_module": module_name, "error": repr(exc), "model_types": model_types},
            )
            continue
        registry.update({model_type: factory for model_type in model_types})
    return registry


def model_type_of(model_dir: Path) -> str:
    """The checkpoint's model_type, from config.json (top level, also for K3's nested text_config)."""
    path = model_dir / "config.json"
    try:
        model_type = json.loads(path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerLoadError(f"{path}: cannot read the model_type: {exc}") from exc
    if not isinstance(model_type, str) or not model_type:
        raise TokenizerLoadError(f"{path}: no model_type")
    return model_type


def load_for_model(
    model_dir: Path, model_type: str | None = None, registry: Mapping[str, TokenizerFactory] | None = None
) -> tuple[str, LoadedTokenizer]:
    """(model_type, tokenizer) for a checkpoint; model_type defaults to config.json's."""
    model_type = model_type or model_type_of(model_dir)
    registry = build_registry() if registry is None else registry
    if model_type not in registry:
        raise UnsupportedModelType(
            f"{model_dir}: no tokenizer registered for model_type {model_type!r} (registered: {sorted(registry)})"
        )
    return model_type, registry[model_type](model_dir)
