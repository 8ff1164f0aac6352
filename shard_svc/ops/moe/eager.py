"""Eager MoE: sigmoid router with bias-for-selection-only, and a loop over the experts that got tokens."""

import torch

from shard_svc.ops.precision import acc_dtype, upcast

from shard_svc.ops.activations import glu


def moe_route(
    x: torch.Tensor,  # [T, D]
    gate_weight: torch.Tensor,  # [E, D]
    correction_bias: torch.Tensor,  # [E]
    top_k: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights [T, k] fp32, expert ids [T, k] int64).

    The bias only chooses experts; the weights are the chosen ones' unbiased sigmoid scores (docs/models.md#routing).
    """
    scores = torch.sigmoid(upcast(x) @ upcast(gate_weight).t())
    ids = torch.topk(scores + upcast(correction_bias), top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def moe_experts(
    x: torch.Tensor,  # [T, Din]
    weights: torch.Tensor,  # [T, k] fp32
    ids: torch.Tensor,  # [T, k]
    w1: torch.Tensor,  # [E, I, Din] gate
    w3: torch.Tensor,  # [E, I, Din] up
    w2: torch.Tensor,  # [E, Din, I] down
    activation: str,
    situ_betas: tuple[float, float],
) -> torch.Tensor:
    """Weighted sum over each token's chosen experts of w2(act(w1 x, w3 x)); [T, Din] in x's dtype."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=acc_dtype(x.dtype), device=x.device)
    for e in torch.unique(ids).tolist():
        token_idx, which = (ids == e).nonzero(as_tuple=True)
        xe = x[token_idx]
        h = glu(xe @ w1[e].t(), xe @ w3[e].t(), activation, situ_betas)
        out.index_add_(0, token_idx, upcast(h @ w2[e].t()) * weights[token_idx, which].unsqueeze(-1))
    return out.to(x.dtype)
