"""The MoE block's experts with its shared expert: at decode sizes the shared expert is one more expert of the
grouped kernels (`moe.py`), every token's last choice at weight 1.

Reference: `shard_svc/ops/moe/eager.py::with_shared_expert` over the eager ops. Run on its own, a decode step's
shared expert is five launches per MoE layer (the gate|up product and its split-K sum, the activation, the down
product, the add to the routed sum); here its rows join the routed pairs, so its products and activation ride in the
gate/up and down launches and the add in the combine, in fp32 before the one rounding (the composed op rounds the
routed sum first: the two differ by that rounding). Up to `FUSE_MAX_TOKENS` tokens the shared expert's weights are
read once per M-block of its run (one block at decode); above it the shared expert's products go to `linear`
(cuBLAS), composed as the reference is.
"""

from __future__ import annotations

import torch

from shard_svc.ops.moe.eager import with_shared_expert
from shard_svc.ops.triton.common import TritonKernelError, check
from shard_svc.ops.triton.glu import glu
from shard_svc.ops.triton.linear import linear
from shard_svc.ops.triton.moe import CHUNK_PAIRS, SMALL_ALIGN_MAX, check_experts, moe_experts, moe_pass, run_in_chunks

FUSE_MAX_TOKENS = 16  # tokens up to which the shared expert joins the grouped kernels (decode batches)

composed = with_shared_expert(moe_experts, linear, glu)


def fusable(x: torch.Tensor, w1: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor,
            max_tokens: int) -> bool:
    """The dispatch rule: few tokens, and a shared expert shaped like one routed expert (one shared expert of the
    routed width, not a latent MoE's wider one)."""
    inter, d = w1.shape[1], x.shape[1]
    return (x.shape[0] <= max_tokens and tuple(shared_gate_up.shape) == (2 * inter, d)
            and tuple(shared_down.shape) == (d, inter))


def moe_experts_shared(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                       w3: torch.Tensor, w2: torch.Tensor, activation: str, situ_betas: tuple[float, float],
                       shared_gate_up: torch.Tensor, shared_down: torch.Tensor,
                       max_tokens: int = FUSE_MAX_TOKENS) -> torch.Tensor:
    """Same contract as the eager `moe_experts_shared` (`with_shared_expert`). A shape dispatch between two correct
    paths, not a fallback: `fusable` shapes run the shared expert inside the grouped kernels, others compose."""
    if not fusable(x, w1, shared_gate_up, shared_down, max_tokens):
        return composed(x, weights, ids, w1, w3, w2, activation, situ_betas, shared_gate_up, shared_down)
    op = "moe_experts_shared"
    check_experts(op, x, weights, ids, w1, w3, w2, activation)
    for name, w in (("shared_gate_up", shared_gate_up), ("shared_down", shared_down)):
        check(op, name, w, dtypes=(x.dtype,), dims=2)
        if w.stride(0) != w.shape[1]:
            raise TritonKernelError(f"{op}: {name} {tuple(w.shape)} must have contiguous rows (strides {w.stride()})")
    shared = (shared_gate_up, shared_down)
    return run_in_chunks(x, weights, ids, CHUNK_PAIRS, lambda xs, ws, ids_s, out: moe_pass(
        xs, ws, ids_s, w1, w3, w2, activation, situ_betas, out, SMALL_ALIGN_MAX, None, shared=shared))


moe_experts_shared.graph_safe = True  # both paths: no host sync, buffers and grids from shapes only
