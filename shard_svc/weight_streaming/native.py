"""Loads the native engine, built from the C++ source in the top-level `native` package, with its errors mapped to
ours.

The source travels as package data, so an installed kimiserve (a wheel, the Docker image) builds the same engine as
a checkout; the image prebuilds it (Dockerfile), and `native/build.py` loads that build without writing.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from native import build
from shard_svc.weight_streaming.errors import NATIVE_KINDS, NativeBuildError

log = logging.getLogger(__name__)

_lock = threading.Lock()


def native_source() -> Path:
    """The engine's C++ source inside the installed package; a named error where the install lacks it."""
    if not build.SOURCE.is_file():
        raise NativeBuildError(f"native source not found: {build.SOURCE} (this install of kimiserve lacks the package "
                               "data of the native package; reinstall it)")
    return build.SOURCE


def load_native(device: torch.device | str | None = None):
    """The native module for `device` (built on first use). A CUDA device needs the CUDA build; raises if absent."""
    device = torch.device(device or "cpu")
    with _lock:
        native_source()
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
