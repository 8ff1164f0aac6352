"""Batch-invariant ops (`kimiserve shard --batch-invariant`): a token's rows come out the same bits whatever else
shares its pass, so a prompt prefilled in any split (a prefix-cache restore's short tail, the fair scheduler's
chunks) gives what one pass over it gives, and a restored prompt's greedy reply is a cold one's, bit for bit.

On the Triton backend three choices follow a pass's size and so round a row differently in a short pass than in a
long one (bench/split_divergence.py found them in this order on an H100; README "Split invariance"):
- `linear`: cuBLAS picks its kernel by M, and passes of at most 4 rows take the skinny decode GEMM. Here every
  product runs one Triton tiling (ops/triton/invariant_linear.py).
- `moe_route`: the router logits split K over more programs when a pass has few tokens. Here K is never split.
- `moe_experts`: the M-block, and with it the K step, follows the pass's rows per expert; the fused shared-expert op
  runs only small passes. Here one M-block for every pass, and the model composes the shared expert from linear and
  glu.
Also `mla_prefill` keeps the Triton kernel for every length (no cuDNN for long sequences: one kernel, one order).
Decode-only passes keep the fast ops (assemble.py hands both sets to the runner): only prompt rows have to round
alike in any split, and the invariant GEMM at decode's few rows cost 2.3x the TPOT at batch 1 on an H100.
What this costs in speed is measured by the benchmarks with the flag; what it leaves variant, if anything, by
`python -m bench.split_divergence --batch-invariant`.
"""

from __future__ import annotations

import dataclasses
import functools

from shard_svc.ops import OpBackendError, Ops

EXPERT_BLOCK_M = 64  # the routed experts' one M-block: the prefill passes' usual one at the 48B shape


def _graph_safe(op):
    op.graph_safe = True  # each wrapped kernel is graph-safe itself (no host sync, grids from shapes)
    return op


def batch_invariant(ops: Ops) -> Ops:
    """`ops` (the Triton backend's) with the choices above fixed. Raises OpBackendError on another backend."""
    backends = dict(ops.backends)
    if not backends.get("linear", "").startswith("triton"):
        raise OpBackendError(f"--batch-invariant needs the Triton op backend (a CUDA device, or TRITON_INTERPRET=1 "
                             f"on the CPU); this shard's ops are served by {backends}")
    from shard_svc.ops.triton.invariant_linear import invariant_linear
    from shard_svc.ops.triton.mla_prefill import mla_prefill
    from shard_svc.ops.triton.moe import moe_experts
    from shard_svc.ops.triton.moe_route import moe_route

    backends.update(linear="triton, batch-invariant", moe_route="triton, K unsplit",
                    moe_experts=f"triton, M-block {EXPERT_BLOCK_M}", moe_experts_shared="composed in the model",
                    mla_prefill="triton")
    return dataclasses.replace(
        ops, linear=invariant_linear, moe_route=_graph_safe(functools.partial(moe_route, split_k=1)),
        moe_experts=_graph_safe(functools.partial(moe_experts, block_m=EXPERT_BLOCK_M)), moe_experts_shared=None,
        mla_prefill=mla_prefill, backends=tuple(sorted(backends.items())))
