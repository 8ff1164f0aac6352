"""The op dispatch seam: every op the model calls, by name, from one selected backend.

The model file only calls `ops.<name>(...)`; a faster backend (Triton) registers replacements for some names and
the rest stay eager. Which backend serves each op is logged once at startup, so nothing switches silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from shard_svc.ops import activations, conv, norm
from shard_svc.ops.kda import eager as kda_eager
from shard_svc.ops.mla import eager as mla_eager
from shard_svc.ops.moe import eager as moe_eager

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ops:
    linear: Callable  # (x [..., K], weight [N, K]) -> [..., N]: every linear layer but the routed experts
    rms_norm: Callable
    add_rms_norm: Callable  # (x, residual, weight, eps) -> (rms_norm(residual + x), residual + x)
    gated_rms_norm: Callable
    glu: Callable  # (gate, up, activation, situ_betas) -> act(gate) * up: the dense MLP's and shared experts'
    short_conv: Callable
    kda_prefill: Callable
    kda_decode: Callable
    mla_cache_write: Callable  # (cache, c_kv, k_pe, norm weight, eps, slot mapping): norm(c_kv) | k_pe into the cache
    mla_prefill: Callable
    mla_decode: Callable
    moe_route: Callable
    moe_experts: Callable
    # A backend's fused op for the routed experts plus a shared expert; None: the model composes moe_experts, linear
    # and glu (ops/moe/eager.py::with_shared_expert, the reference).
    moe_experts_shared: Callable | None = None
    backends: tuple[tuple[str, str], ...] = ()  # (op name, backend that serves it)


EAGER: dict[str, Callable] = {
    "linear": F.linear,  # exactly what nn.Linear(bias=False) runs
    "rms_norm": norm.rms_norm,
    "add_rms_norm": norm.add_rms_norm,
    "gated_rms_norm": norm.gated_rms_norm,
    "glu": activations.glu,
    "short_conv": conv.short_conv,
    "kda_prefill": kda_eager.kda_prefill,
    "kda_decode": kda_eager.kda_decode,
    "mla_cache_write": mla_eager.mla_cache_write,
    "mla_prefill": mla_eager.mla_attention,
    "mla_decode": mla_eager.mla_attention,
    "moe_route": moe_eager.moe_route,
    "moe_experts": moe_eager.moe_experts,
}

# Ops a backend may provide fused; without one the model composes their parts (logged as such).
FUSED_ONLY = ("moe_experts_shared",)

# backend name -> loader returning {op name: implementation}; loaders import lazily (Triton needs a GPU).
BACKENDS: dict[str, Callable[[], dict[str, Callable]]] = {"eager": lambda: EAGER}
BACKENDS["triton"] = lambda: __import__("shard_svc.ops.triton", fromlist=["load"]).load()


class OpBackendError(RuntimeError):
    """A requested op backend cannot run on this device."""


def select_ops(device: torch.device, backend: str = "auto") -> Ops:
    """`auto` is eager on the CPU and `triton` on CUDA; an explicitly requested backend that fails raises."""
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and "triton" in BACKENDS else "eager"
    if backend not in BACKENDS:
        raise OpBackendError(f"unknown op backend {backend!r} (known: {sorted(BACKENDS)})")
    impls = dict(EAGER)
    served = {name: "eager" for name in EAGER}
    if backend != "eager":
        try:
            overrides = BACKENDS[backend]()
        except Exception as e:  # noqa: BLE001 - re-raised as a named error with the cause
            raise OpBackendError(f"op backend {backend!r} failed to load on {device}: {e}") from e
        impls.update(overrides)
        # an implementation that hands part of its work to a library says so (`served_by`)
        served.update({name: getattr(impl, "served_by", backend) for name, impl in overrides.items()})
    for name in FUSED_ONLY:
        served.setdefault(name, "composed in the model")
    ops = Ops(**impls, backends=tuple(sorted(served.items())))
    log.info("op backends selected", extra={"device": str(device), "ops": dict(ops.backends)})
    return ops
