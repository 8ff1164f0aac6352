"""The prefix cache's host tier: entries evicted from the device kept in host memory instead of dropped.

A device entry is one KDA state slot plus the MLA KV blocks of its prefix (shard_svc/engine/prefix_cache.py). When
it is evicted with this tier on, its state, its KV blocks (every block of the prefix, the last partial one too) and
its logits row are copied into host tensors of their own (pinned on a GPU, so the copies back can overlap), before
the device slot and blocks are freed. The tier is bounded by an entry count, not bytes, so every rank of a shard
group (each holding its own head slice, so its own byte sizes) makes the same decisions. Its least valuable entry
(the cache's policy, prefix_cache.py) is dropped for good when a new one comes in: nothing reads it again.

A hit on a host entry copies it straight into the restoring sequence: the state into the sequence's fresh slot, the
KV into fresh blocks of its own (nothing is shared with a host entry), the logits row back to the device. The entry
stays on the host (now most recently used) for the next request that starts the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from shard_svc.errors import KimiServeError, KVBlocksExhausted
from shard_svc.state.pools import KDAStatePool, MLAKVCache

log = logging.getLogger(__name__)


class PrefixHostConfigError(KimiServeError):
    """The host tier was asked for with sizes it cannot run with."""


class PrefixHostError(KimiServeError):
    """A host tier copy could not be made as the entry's sizes say (a bug: nothing is restored)."""


@dataclass
class HostPrefix:
    tokens: list[int]
    recurrent: torch.Tensor  # [num_kda, H, K, V] fp32, host
    conv: torch.Tensor  # [num_kda, 3HK, W-1], host
    kv: torch.Tensor  # [num_mla, blocks, block_size, latent], host: every block of the prefix
    logits: torch.Tensor  # fp32 [vocab], host: the model's logits at position len(tokens) - 1
    salt: str = ""  # as the device entry's (prefix_cache.py CachedPrefix)
    hits: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.recurrent, self.conv, self.kv, self.logits))


class PrefixHostTier:
    """Copies entries between the device pools and host tensors; the index of host entries is the cache's."""

    def __init__(self, kda_pool: KDAStatePool, kv_cache: MLAKVCache, max_entries: int):
        if max_entries < 1:
            raise PrefixHostConfigError(f"a prefix cache host tier needs at least one entry; got {max_entries}")
        self.kda_pool, self.kv_cache, self.max_entries = kda_pool, kv_cache, max_entries
        self.pin = kv_cache.kv.is_cuda  # pinned host memory only where there is a device to copy to
        self.nbytes = 0  # host bytes the entries hold

    def _host(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pin)

    def save(self, tokens: list[int], slot: int, blocks: list[int], logits: torch.Tensor) -> HostPrefix:
        """Host copies of a device entry's state slot, KV blocks and logits row. The copies are complete when this
        returns (blocking copies), so the caller may free the slot and blocks at once."""
        bs = self.kv_cache.block_size
        if len(blocks) != -(-len(tokens) // bs):
            raise PrefixHostError(f"prefix of {len(tokens)} tokens holds {len(blocks)} KV blocks of {bs}; "
                                  f"expected {-(-len(tokens) // bs)}")
        pool, kv = self.kda_pool, self.kv_cache.kv
        index = torch.tensor(blocks, dtype=torch.long, device=kv.device)
        parts = [pool.recurrent[:, slot], pool.conv[:, slot], kv.index_select(1, index), logits]
        host = [self._host(p) for p in parts]
        for dst, src in zip(host, parts):
            dst.copy_(src)
        entry = HostPrefix(list(tokens), *host)
        self.nbytes += entry.nbytes
        return entry

    def dropped(self, entry: HostPrefix) -> None:
        """The cache dropped `entry` from its index: its memory no longer counts."""
        self.nbytes -= entry.nbytes

    def load(self, entry: HostPrefix, owner: str, slot: int) -> torch.Tensor:
        """Copies a host entry into `owner` (a sequence holding the fresh state slot `slot` and no KV blocks): its
        state into the slot, its KV into fresh blocks of the owner's table. Returns the logits row on the device.
        The copies are queued on the current stream, so the next forward reads them."""
        pool, cache = self.kda_pool, self.kv_cache
        if cache.blocks.table(owner):
            raise PrefixHostError(f"{owner!r} already holds KV blocks {cache.blocks.table(owner)}; a host prefix "
                                  "restores into a sequence without any")
        try:
            blocks = cache.blocks.reserve(owner, entry.length)
        except KVBlocksExhausted as e:  # admission counted these blocks: reaching here is a bug, not a full cache
            raise PrefixHostError(f"{owner!r}: no room for the {entry.kv.shape[1]} KV blocks of its host prefix "
                                  f"({entry.length} tokens): {e}") from e
        if len(blocks) != entry.kv.shape[1]:
            raise PrefixHostError(f"{owner!r}: {len(blocks)} KV blocks reserved for a host prefix of "
                                  f"{entry.kv.shape[1]} blocks ({entry.length} tokens)")
        index = torch.tensor(blocks, dtype=torch.long, device=cache.kv.device)
        # non_blocking from pinned memory: the host allocator keeps the pages until the copy has run, even if the
        # entry is dropped meanwhile.
        cache.kv.index_copy_(1, index, entry.kv.to(cache.kv.device, non_blocking=self.pin))
        pool.recurrent[:, slot].copy_(entry.recurrent, non_blocking=self.pin)
        pool.conv[:, slot].copy_(entry.conv, non_blocking=self.pin)
        return entry.logits.to(cache.kv.device, non_blocking=self.pin)
