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

from shard_svc.errors import KimiServeError
from shard_svc.state.host_copy import HostCopier, HostState
from shard_svc.state.pools import KDAStatePool, MLAKVCache

log = logging.getLogger(__name__)


class PrefixHostConfigError(KimiServeError):
    """The host tier was asked for with sizes it cannot run with."""


@dataclass
class HostPrefix:
    tokens: list[int]
    state: HostState  # the KDA state and every KV block of the prefix (shard_svc/state/host_copy.py)
    logits: torch.Tensor  # fp32 [vocab], host: the model's logits at position len(tokens) - 1
    salt: str = ""  # as the device entry's (prefix_cache.py CachedPrefix)
    hits: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + self.logits.nbytes


class PrefixHostTier:
    """Copies entries between the device pools and host tensors; the index of host entries is the cache's."""

    def __init__(self, kda_pool: KDAStatePool, kv_cache: MLAKVCache, max_entries: int):
        if max_entries < 1:
            raise PrefixHostConfigError(f"a prefix cache host tier needs at least one entry; got {max_entries}")
        self.copier = HostCopier(kda_pool, kv_cache)
        self.max_entries = max_entries
        self.nbytes = 0  # host bytes the entries hold

    def save(self, tokens: list[int], slot: int, blocks: list[int], logits: torch.Tensor) -> HostPrefix:
        """Host copies of a device entry's state slot, KV blocks and logits row, complete when this returns (the
        caller may free the slot and blocks at once)."""
        state = self.copier.save(slot, blocks, len(tokens))
        host_logits = self.copier.host_like(logits)
        host_logits.copy_(logits)
        entry = HostPrefix(list(tokens), state, host_logits)
        self.nbytes += entry.nbytes
        return entry

    def dropped(self, entry: HostPrefix) -> None:
        """The cache dropped `entry` from its index: its memory no longer counts."""
        self.nbytes -= entry.nbytes

    def load(self, entry: HostPrefix, owner: str, slot: int) -> torch.Tensor:
        """Copies a host entry into `owner` (a sequence holding the fresh state slot `slot` and no KV blocks).
        Returns the logits row on the device."""
        self.copier.load(entry.state, owner, slot, entry.length)
        return entry.logits.to(self.copier.kv_cache.kv.device, non_blocking=self.copier.pin)
