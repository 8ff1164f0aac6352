"""One sequence's share of a forward pass, built in one place for both the eager runner (shard_svc/engine/runner.py)
and the decode CUDA graphs (shard_svc/engine/cuda_graphs.py): its new token ids, where they go in the KV cache, and
its KDA state slot. Building a row also prepares the pools for it (a fresh sequence's slot is zeroed, cache room for
the new tokens is reserved), so neither path can forget one of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_svc.engine.sequence import Sequence
from shard_svc.state.pools import KDAStatePool, MLAKVCache


@dataclass(frozen=True)
class StepRow:
    tokens: list[int]  # the new token ids of this pass (one for a decode step)
    ctx_len: int  # tokens cached before this pass (the first new token goes to this position)
    slot: int  # KDA state slot
    table: list[int]  # MLA cache blocks, already holding room for the new tokens

    def slot_mapping(self, block_size: int) -> list[int]:
        """The flat cache position (block * block_size + offset) of each new token."""
        return [self.table[p // block_size] * block_size + p % block_size
                for p in range(self.ctx_len, self.ctx_len + len(self.tokens))]


def build_rows(work: list[tuple[Sequence, int]], kda_pool: KDAStatePool, kv_cache: MLAKVCache) -> list[StepRow]:
    """A row for each (sequence, new tokens) of a pass, in order. Advances nothing: the runner moves num_computed on
    once the pass has run."""
    rows = []
    for seq, n in work:
        start = seq.num_computed
        if start == 0:
            kda_pool.zero_slot(seq.slot)
        kv_cache.reserve(seq.request_id, start + n)
        p = len(seq.prompt)
        # slices of prompt and output: `seq.tokens` would copy the whole context for every sequence, every step
        tokens = seq.prompt[start:start + n] + seq.output[max(0, start - p):max(0, start + n - p)]
        rows.append(StepRow(tokens, start, seq.slot, kv_cache.blocks.table(seq.request_id)))
    return rows
