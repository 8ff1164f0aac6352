"""KDA per-channel log-decay and the q/k/beta preprocessing shared by every KDA op."""

import torch

from shard_svc.ops.precision import upcast
import torch.nn.functional as F


def kda_gate(
    f: torch.Tensor,  # [T, H, K] raw gate projection f_b(f_a(x))
    a_log: torch.Tensor,  # [H] fp32
    dt_bias: torch.Tensor,  # [H*K] fp32
    lower_bound: float | None,
) -> torch.Tensor:
    """Log-space decay g [T, H, K] fp32, every entry < 0.

    Kimi-Linear: g = -exp(A_log) * softplus(f + dt_bias). K3: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)).
    """
    t, h, k = f.shape
    x = upcast(f) + upcast(dt_bias).view(h, k)
    a = torch.exp(upcast(a_log)).view(1, h, 1)
    if lower_bound is None:
        return -a * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(a * x)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in fp32."""
    xf = upcast(x)
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def prepare_qkb(q: torch.Tensor, k: torch.Tensor, beta_logits: torch.Tensor):
    """fp32 q (L2-normed, scaled by K^-0.5), k (L2-normed) and beta = sigmoid(logits)."""
    head_dim = q.shape[-1]
    return l2_normalize(q) * head_dim**-0.5, l2_normalize(k), torch.sigmoid(upcast(beta_logits))
