"""Kernel tests: compiled on CUDA when a GPU is present, else on Triton's CPU interpreter (TRITON_INTERPRET=1).

The interpreter is chosen when a kernel is decorated (module import) and consulted while it runs, so the variable
is set only around the import of the kernel modules below and, through a fixture, while this folder's tests run.
It never stays set for other test folders.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from tests.kernels import interpreter_speed

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# modules with @triton.jit, in import order (shared device functions first)
KERNEL_MODULES = ("jit_helpers", "kda_gate", "kda_decode", "kda_chunk", "short_conv", "norm", "glu", "mla_cache")


def _interpreted(triton_module) -> bool:
    return type(triton_module.language.standard.cumsum).__name__ == "InterpretedFunction"


def _import_kernels() -> None:
    """Import the kernel modules (and, on the CPU, Triton itself) in the right mode. Triton is a required dependency
    on Linux x86_64 (pyproject), so a failed import fails these tests instead of skipping them.

    Triton decorates its own library (tl.cumsum, tl.sigmoid, ...) when it is first imported, so on the CPU it must
    be imported with TRITON_INTERPRET=1; if another folder imported it compiled, it is imported afresh.
    """
    old = os.environ.get("TRITON_INTERPRET")
    if not ON_GPU:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
        if not ON_GPU and not _interpreted(triton):
            for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
                del sys.modules[name]
            import triton  # noqa: F401,F811
        if not ON_GPU:
            interpreter_speed.install()
        for name in KERNEL_MODULES:
            full = f"shard_svc.ops.triton.{name}"
            if full in sys.modules:
                importlib.reload(sys.modules[full])
            else:
                importlib.import_module(full)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


_import_kernels()


def kernel_module(name: str, kernel: str, shares_from: tuple[str, ...] = ()):
    """shard_svc.ops.triton.<name>, decorated in the mode this folder runs in (interpreted on the CPU), judged by
    its `kernel`; `shares_from`: modules whose jitted helpers it imports, reloaded first in the same mode."""
    mod = importlib.import_module(f"shard_svc.ops.triton.{name}")
    if not ON_GPU and type(getattr(mod, kernel)).__name__ != "InterpretedFunction":
        for dep in shares_from:
            importlib.reload(importlib.import_module(f"shard_svc.ops.triton.{dep}"))
        mod = importlib.reload(mod)
    return mod


@pytest.fixture(autouse=True)
def _triton_mode(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out is an infinite error."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e} (max abs diff " \
                       f"{(out.double().cpu() - ref.double().cpu()).abs().max().item():.3e})"


def poisoned_pool(shape, used: torch.Tensor, dtype=torch.float32, scale: float = 0.5) -> torch.Tensor:
    """A pool whose used slots hold random values and whose other slots are NaN (must stay untouched)."""
    pool = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    pool[used] = (torch.randn(used.shape[0], *shape[1:], device=DEVICE) * scale).to(dtype)
    return pool


def assert_unused_untouched(name: str, pool: torch.Tensor, used: torch.Tensor) -> None:
    unused = torch.ones(pool.shape[0], dtype=torch.bool, device=pool.device)
    unused[used] = False
    assert torch.isnan(pool[unused]).all(), f"{name}: an unused (NaN-poisoned) pool slot was written"


def cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, dtype=torch.int64, device=DEVICE).cumsum(0)
