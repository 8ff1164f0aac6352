"""The packed-varlen side of the `kda_prefill` contract, shared by the eager chunked op (eager.py) and the token-loop
reference (naive.py), which differ only in how they compute one sequence.

Sharing it leaves the reference what it is for, an independent recurrence. This bookkeeping (the batch cut by
cu_seqlens, each initial state read from the pool by slot and the final state written back) is still checked
against code that shares none of it: the Triton kernels gate, normalise, split the batch and address the pool on
their own and are tested against the reference with permuted slots and a poisoned pool
(tests/kernels/test_kda_chunk.py)."""

from typing import Callable

import torch

from shard_svc.ops.kda.gate import kda_gate, prepare_qkb

# (q, k, v, g, beta, state) of one sequence -> (o, final state): q, k, g [L, H, K], v [L, H, V], beta [L, H],
# state [H, K, V], all but v fp32 (q, k normalised, q scaled, g the log-decay).
OneSequence = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                       tuple[torch.Tensor, torch.Tensor]]


def kda_varlen(one_sequence: OneSequence, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
               beta_logits: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
               state_pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The `kda_prefill` op (arguments as there) with `one_sequence` computing each sequence from its slot's state;
    returns o [T, H, V] in v's dtype and leaves each final state in its slot."""
    g = kda_gate(f, a_log, dt_bias, lower_bound)
    qn, kn, beta = prepare_qkb(q, k, beta_logits)
    out = torch.empty_like(v)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slots.tolist()):
        s, e = bounds[b], bounds[b + 1]
        o, final = one_sequence(qn[s:e], kn[s:e], v[s:e], g[s:e], beta[s:e], state_pool[slot])
        out[s:e] = o.to(v.dtype)
        state_pool[slot] = final
    return out
