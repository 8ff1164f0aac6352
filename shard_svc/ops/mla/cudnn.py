"""cuDNN's fused attention as an `Attend` (shard_svc/ops/mla/long_context.py), checked on the device before use.

`torch.ops.aten._scaled_dot_product_cudnn_attention` is what `F.scaled_dot_product_attention` runs on its cuDNN
backend; called directly it also returns the log-sum-exp that the long-context parts merge by. It is a private op,
so its conventions (natural log, the lse's shape, the top-left causal mask, head dims qk != v) are checked against
`math_attend` on each device, dtype and head shape before the first call serves with it: a torch whose op differs
raises `AttentionLibraryError` naming the shapes and errors, instead of serving wrong attention.
"""

from __future__ import annotations

import torch

from shard_svc.errors import KimiServeError
from shard_svc.ops.mla.long_context import math_attend

CHECK_TOLERANCE = 2e-2  # relative error of o, absolute of lse (bf16 inputs)

_checked: set[tuple] = set()


class AttentionLibraryError(KimiServeError):
    """A fused attention library call failed, or disagreed with the reference on this device."""


def cudnn_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [M, nh, d], k [N, nh, d], v [N, nh, dv] on a CUDA device -> (o [M, nh, dv] in q's dtype, lse [M, nh] fp32)."""
    check_cudnn_attend(q.device, q.dtype, q.shape[1], q.shape[2], v.shape[2])
    return _call(q, k, v, causal, scale)


def _call(q, k, v, causal, scale):
    # [1, nh, L, d] views of the token-major tensors: the layout models hand F.scaled_dot_product_attention
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    try:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, causal, False,
                                                                 scale=scale)
    except RuntimeError as e:
        raise AttentionLibraryError(f"cuDNN attention failed on {q.device} (torch {torch.__version__}) for q "
                                    f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} {q.dtype}, "
                                    f"causal {causal}: {e}") from e
    return out[0][0].transpose(0, 1), out[1].reshape(q.shape[1], q.shape[0]).t().float()


def check_cudnn_attend(device: torch.device, dtype: torch.dtype, heads: int, qk_dim: int, v_dim: int) -> None:
    """Raises AttentionLibraryError unless cuDNN agrees with `math_attend` at this head shape, causal and not, with
    more keys than queries; runs once per (device, dtype, shape)."""
    key = (str(device), dtype, heads, qk_dim, v_dim)
    if key in _checked:
        return
    g = torch.Generator(device=device).manual_seed(0)
    for m, n, causal in ((160, 160, True), (96, 300, False)):
        q, k = (torch.randn(rows, heads, qk_dim, device=device, generator=g).to(dtype) for rows in (m, n))
        v = torch.randn(n, heads, v_dim, device=device, generator=g).to(dtype)
        scale = qk_dim ** -0.5
        o, lse = _call(q, k, v, causal, scale)
        ref_o, ref_lse = math_attend(q, k, v, causal, scale)
        err_o = ((o.float() - ref_o).norm() / ref_o.norm()).item()
        err_lse = (lse - ref_lse).abs().max().item()
        if not (err_o <= CHECK_TOLERANCE and err_lse <= CHECK_TOLERANCE):
            raise AttentionLibraryError(
                f"cuDNN attention disagrees with the reference on {device} (torch {torch.__version__}, {dtype}, "
                f"{heads} heads, qk {qk_dim}, v {v_dim}, {m} queries x {n} keys, causal {causal}): relative error "
                f"of o {err_o:.3g}, largest lse error {err_lse:.3g}, tolerance {CHECK_TOLERANCE}")
    _checked.add(key)
