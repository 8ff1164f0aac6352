"""The packed-varlen side of the `kda_prefill` contract, shared by the eager chunked op (eager.py) and the token-loop
reference (naive.py), which differ only in how they compute one sequence.

Sharing it leaves the reference what it is for, an independent recurrence. This bookkeeping (the batch cut by
cu_seqlens, each initial state read from the pool by slot and the final state written back) is still checked
against code that shares none of it: the Triton kernels gate, normalise, split the batch and address the pool on
their own and are tested against the reference with permuted slots and a poisoned pool
(tests/kernels/test_kda_chunk.py)."""

from typing import Callable

import torch

from shard_svc.ops.kda.snapshots import StateSnapshots
from shard_svc.ops.kda.gate import kda_gate, prepare_qkb

# (q, k, v, g, beta, state) of one sequence -> (o, final state): q, k, g [L, H, K], v [L, H, V], beta [L, H],
# state [H, K, V], all but v fp32 (q, k normalised, q scaled, g the log-decay).
OneSequence = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                       tuple[torch.Tensor, torch.Tensor]]


def kda_varlen(one_sequence: OneSequence, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
               beta_logits: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None,
               state_pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
               snapshots: StateSnapshots | None = None) -> torch.Tensor:
    """The `kda_prefill` op (arguments as there) with `one_sequence` computing each sequence from its slot's state;
    returns o [T, H, V] in v's dtype and leaves each final state in its slot (and with `snapshots`, the state at
    each point in the point's slot: a sequence is computed segment after segment)."""
    g = kda_gate(f, a_log, dt_bias, lower_bound)
    qn, kn, beta = prepare_qkb(q, k, beta_logits)
    out = torch.empty_like(v)
    if snapshots is None:
        bounds, seg_slots, seq_segs = cu_seqlens.tolist(), slots.tolist(), list(range(slots.shape[0] + 1))
    else:
        bounds, seg_slots = snapshots.cu_segments.tolist(), snapshots.segment_slots.tolist()
        seq_segs = snapshots.sequence_segments.tolist()
    for b, slot in enumerate(slots.tolist()):
        state = state_pool[slot]
        for seg in range(seq_segs[b], seq_segs[b + 1]):
            s, e = bounds[seg], bounds[seg + 1]
            o, state = one_sequence(qn[s:e], kn[s:e], v[s:e], g[s:e], beta[s:e], state)
            out[s:e] = o.to(v.dtype)
            state_pool[seg_slots[seg]] = state
    return out
