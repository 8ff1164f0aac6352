"""Eager MoE: sigmoid router with bias-for-selection-only, and a loop over the experts that got tokens."""

from typing import Callable

import torch

from shard_svc.ops.activations import glu
from shard_svc.ops.precision import acc_dtype, upcast


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
    scores = router_scores(x, gate_weight)
    ids = torch.topk(scores + upcast(correction_bias), top_k, dim=-1, sorted=True).indices
    return chosen_weights(scores, ids, renormalize, scaling), ids


def router_scores(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Unbiased sigmoid scores [T, E] in fp32."""
    return torch.sigmoid(upcast(x) @ upcast(gate_weight).t())


def chosen_weights(scores: torch.Tensor, ids: torch.Tensor, renormalize: bool, scaling: float) -> torch.Tensor:
    """The chosen experts' weights [T, k] from their unbiased scores."""
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling


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


def with_shared_expert(moe_experts: Callable, linear: Callable, glu_op: Callable) -> Callable:
    """The `moe_experts_shared` op composed from a backend's own `moe_experts`, `linear` and `glu`: the routed sum,
    plus the shared expert as the dense MLP runs it (one product with its stacked gate|up rows, the activation, the
    down product), added in x's dtype."""

    def moe_experts_shared(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                           w3: torch.Tensor, w2: torch.Tensor, activation: str, situ_betas: tuple[float, float],
                           shared_gate_up: torch.Tensor, shared_down: torch.Tensor) -> torch.Tensor:
        """`moe_experts(...)` + the shared expert: shared_gate_up [2I', Din] (gate rows, then up), shared_down
        [Din, I']."""
        y = moe_experts(x, weights, ids, w1, w3, w2, activation, situ_betas)
        gate, up = linear(x, shared_gate_up).chunk(2, dim=-1)
        return y + linear(glu_op(gate, up, activation, situ_betas), shared_down)

    return moe_experts_shared
