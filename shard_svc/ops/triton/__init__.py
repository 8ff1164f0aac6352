"""Triton kernels behind the op seam (`BACKENDS["triton"]`), selected automatically on CUDA.

One file per kernel family, each next to the eager reference it is tested against:
`linear.py` (F.linear; a shape dispatch: the skinny decode GEMM for at most 4 rows, F.linear above),
`kda_decode.py` (ops/kda/eager.py::kda_decode), `kda_chunk.py` (ops/kda/eager.py::kda_prefill and the token loop
in ops/kda/naive.py), `short_conv.py` (ops/conv.py), `norm.py` (ops/norm.py: rms_norm, add_rms_norm,
gated_rms_norm), `glu.py` (ops/activations.py), `moe.py`, `moe_shared.py` and `moe_route.py`
(ops/moe/eager.py::moe_experts, with_shared_expert, moe_route), `mla_cache.py` (ops/mla/eager.py::mla_cache_write),
`mla_decode.py` and `mla_prefill.py` (ops/mla/eager.py::mla_attention; on CUDA its long sequences run on cuDNN,
ops/mla/cudnn.py).
Ops not listed in `load()` stay eager. `moe_w4a16.py::moe_experts_w4a16` (packed MXFP4 experts, the contract of
streaming/experts.py::w4a16_moe_experts) has no op-seam name: whoever holds packed experts calls it directly.

An implementation with `graph_safe = True` makes no host sync and sizes every buffer and grid from shapes alone, so
a decode step made of such ops can be captured in a CUDA graph (`shard_svc/engine/cuda_graphs.py`).

Shared by the kernel files: `common.py` (input checks, `TritonKernelError`) and `jit_helpers.py` (the device
functions several kernels call).
"""

from __future__ import annotations

import functools
from typing import Callable

from shard_svc.ops.triton.common import TritonKernelError, interpreting

__all__ = ["load", "TritonKernelError"]

# Ops of other kernel files that are graph-safe on the decode path (one token per sequence): no .tolist()/.item(),
# grids from shapes. Kernel files written with the graph in mind set `graph_safe` themselves.
GRAPH_SAFE = ("kda_decode", "short_conv", "gated_rms_norm", "rms_norm", "add_rms_norm")  # glu.py sets its own


def load() -> dict[str, Callable]:
    """{op name: Triton implementation}; raises if Triton cannot run here (no CUDA device and no interpreter)."""
    import torch

    if not torch.cuda.is_available() and not interpreting():
        raise TritonKernelError("Triton kernels need a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)")
    from shard_svc.ops.triton.glu import glu
    from shard_svc.ops.triton.kda_chunk import kda_prefill
    from shard_svc.ops.triton.kda_decode import kda_decode
    from shard_svc.ops.triton.linear import linear
    from shard_svc.ops.triton.mla_cache import mla_cache_write
    from shard_svc.ops.triton.mla_decode import mla_decode
    from shard_svc.ops.triton.mla_prefill import mla_prefill
    from shard_svc.ops.triton.moe import moe_experts
    from shard_svc.ops.triton.moe_route import moe_route
    from shard_svc.ops.triton.moe_shared import moe_experts_shared
    from shard_svc.ops.triton.norm import add_rms_norm, gated_rms_norm, rms_norm
    from shard_svc.ops.triton.short_conv import short_conv

    impls = {
        "linear": linear,
        "kda_prefill": kda_prefill,
        "kda_decode": kda_decode,
        "short_conv": short_conv,
        "gated_rms_norm": gated_rms_norm,
        "glu": glu,
        "rms_norm": rms_norm,
        "add_rms_norm": add_rms_norm,
        "moe_experts": moe_experts,
        "moe_experts_shared": moe_experts_shared,
        "moe_route": moe_route,
        "mla_cache_write": mla_cache_write,
        "mla_decode": mla_decode,
        "mla_prefill": mla_prefill,
    }
    for name in GRAPH_SAFE:
        impls[name].graph_safe = True
    if torch.cuda.is_available() and not interpreting():
        impls["mla_prefill"] = _with_cudnn_long_context(mla_prefill)
    return impls


def _with_cudnn_long_context(mla_prefill: Callable) -> Callable:
    """The MLA prefill with its long sequences on cuDNN (`ops/mla/cudnn.py`; checked against the reference on first
    use). Not under the interpreter: cuDNN needs the GPU."""
    from shard_svc.ops.mla.cudnn import cudnn_attend
    from shard_svc.ops.triton.mla_prefill import LONG_PAIRS

    op = functools.partial(mla_prefill, long_attend=cudnn_attend)
    op.context_workspace_tokens = mla_prefill.context_workspace_tokens
    op.long_context_pairs = LONG_PAIRS
    op.served_by = "triton; cudnn for long sequences"
    return op
