"""Routed experts read straight from a slot: the W4A16 path for packed MXFP4 experts, strided views for dense ones.

`w4a16_moe_experts` is the eager reference of the W4A16 expert kernel: 4-bit MXFP4 weights, activations in the
model dtype, each routed expert dequantised where it runs and dropped after use. Its loop is the eager MoE's
(ops/moe/eager.py) step for step, and the dequantisation is `dequantize_mxfp4`'s arithmetic, so a streamed layer
gives the resident layer's numbers bit for bit. Checks on the bytes (NaN scales, overflow) ran once at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard_svc.checkpoint.mxfp4 import E2M1_MAGNITUDES, E8M0_BIAS, GROUP
from shard_svc.ops.activations import glu
from shard_svc.ops.precision import acc_dtype, upcast

_E2M1 = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)
_tables: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class StreamedExperts:
    """Stands in for a streamed layer's stacked expert parameter (`experts.w1|w3|w2`): the MoE block passes it to
    `ops.moe_experts`, which the streamer routes to the slot that holds the layer."""

    layer: int
    which: str  # 'w1' | 'w3' | 'w2'


def dequantize_packed(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed uint8 [out, in/2], scale uint8 [out, in/32] -> [out, in] in dtype; `dequantize_mxfp4` minus its checks."""
    table = _tables.get(packed.device)
    if table is None:
        table = _tables[packed.device] = _E2M1.to(packed.device)
    out, half = packed.shape
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(out, 2 * half)  # low nibble first
    values = table[codes.int()].view(out, -1, GROUP)
    multiplier = torch.exp2(scale.to(torch.int32).sub(E8M0_BIAS).float()).unsqueeze(-1)
    return (values * multiplier).view(out, 2 * half).to(dtype)


def w4a16_moe_experts(
    x: torch.Tensor,  # [T, Din]
    weights: torch.Tensor,  # [T, k] fp32
    ids: torch.Tensor,  # [T, k]
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]],  # w1 / w3 / w2: (packed [E, out, in/2], scale)
    activation: str,
    situ_betas: tuple[float, float],
) -> torch.Tensor:
    """Weighted sum over each token's chosen experts of w2(act(w1 x, w3 x)); [T, Din] in x's dtype."""
    w2p = packed["w2"][0]
    out = torch.zeros(x.shape[0], w2p.shape[1], dtype=acc_dtype(x.dtype), device=x.device)
    # One host sync for the whole layer: pairs grouped by expert with a stable sort keep the row-major order that
    # `(ids == e).nonzero()` gives, so every expert sees the same rows in the same order as the eager MoE.
    k, flat = ids.shape[1], ids.flatten()
    order = torch.sort(flat, stable=True).indices
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=w2p.shape[0]).tolist()):
        if not n:
            continue
        pairs, start = order[start:start + n], start + n
        token_idx, which = pairs // k, pairs % k
        xe = x[token_idx]
        w1, w3, w2 = (dequantize_packed(packed[w][0][e], packed[w][1][e], x.dtype) for w in ("w1", "w3", "w2"))
        h = glu(xe @ w1.t(), xe @ w3.t(), activation, situ_betas)
        out.index_add_(0, token_idx, upcast(h @ w2.t()) * weights[token_idx, which].unsqueeze(-1))
    return out.to(x.dtype)
