"""Loads the native engine built from the repository's `native/` directory, with its errors mapped to ours.

The build module (`native/build.py`) is imported by path: `native/` is a source directory beside the Python packages,
not a package on sys.path.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from pathlib import Path

import torch

from shard_svc.streaming.errors import NATIVE_KINDS, NativeBuildError

log = logging.getLogger(__name__)

NATIVE_DIR = Path(__file__).resolve().parents[2] / "native"
_lock = threading.Lock()
_build = None


def _build_module():
    global _build
    if _build is not None:
        return _build
    path = NATIVE_DIR / "build.py"
    if not path.is_file():
        raise NativeBuildError(f"native sources not found: {path} (the streaming engine ships beside shard_svc)")
    spec = importlib.util.spec_from_file_location("kimiserve_native_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    _build = module
    return module


def load_native(device: torch.device | str | None = None):
    """The native module for `device` (built on first use). A CUDA device needs the CUDA build; raises if absent."""
    device = torch.device(device or "cpu")
    with _lock:
        build = _build_module()
        try:
            module = build.load()
        except build.NativeBuildFailed as e:
            raise NativeBuildError(str(e)) from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NativeBuildError(f"device {device} asked for, but torch sees no CUDA device (torch {torch.__version__})")
    if device.type not in ("cpu", "cuda"):
        raise NativeBuildError(f"weight streaming runs on cpu or cuda devices, not {device}")
    module.register_errors(dict(NATIVE_KINDS))
    if getattr(module, "BUILD_SECONDS", 0) > 1:
        log.info("native streaming engine built in %.1f s at %s", module.BUILD_SECONDS, module.BUILD_DIR)
    return module
