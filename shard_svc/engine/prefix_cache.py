"""Hybrid prefix cache: a request restores the longest cached prefix of its prompt and prefills only the rest.

What a prefix of L tokens needs to be skipped: the MLA latent KV of positions [0, L) and the KDA recurrent + conv
state after L tokens (K3's block attention residuals mix layer outputs of one position, so they carry nothing across
positions). The KV is paged: an entry shares the full blocks of its prefix by reference count (block_size tokens
each, never written again, since a sequence writes only positions past its own cached length), plus its last,
partly filled block, which a restoring sequence copies into a block of its own before writing after it. The KDA
state is fixed-size per sequence (about 41 MiB at the 48B shape), so an entry holds one whole state slot of the
KDA pool: a slot of its own, in the slots the pool holds beyond the running sequences. With every entry also goes
the logits row of its last position, so a prompt that is cached whole samples its first token without a pass.

Entries are made (1) at the end of every prompt (copy of the state), (2) every `interval` tokens of a chunked
prefill, at the first pass boundary past each multiple (copy), and (3) when a sequence finishes normally: its slot
is handed over instead of freed (no copy), covering prompt + output, so the next turn of the conversation hits.
Least recently used entries are evicted when the entry slots are full or admission needs KV blocks. An entry is
removed from the index before its slot and blocks are freed, so an evicted snapshot cannot be read.

With a host tier (shard_svc/engine/prefix_host.py, `--prefix-host-entries`) an evicted entry is copied to host memory
instead of dropped, within its own LRU bound, and a hit there is copied back into the restoring sequence.

Lookup hashes the prompt block by block (a chain: each block's hash covers every block before it), then tries
the entry lengths longest first (on the device, then on the host), comparing the whole token list on a hash hit:
a collision can never restore another prompt's state (two prompts under one key: the newer entry displaces the older,
whose slot and blocks are freed). Every decision depends only on the token lists and counts, never on byte sizes or
timing (and hash() of int tuples is not salted per process), so every rank of a shard group makes the same ones.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from shard_svc.engine.prefix_host import HostPrefix, PrefixHostTier
from shard_svc.state.allocators import BlockAllocator, SlotAllocator

log = logging.getLogger(__name__)


@dataclass
class CachedPrefix:
    tokens: list[int]
    slot: int
    owner: str  # its block table's owner in the allocator
    logits: torch.Tensor  # fp32 [vocab]: the model's logits at position len(tokens) - 1

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0  # restored from either tier
    evictions: int = 0  # entries that left the device (to the host tier when it is on)
    inserted: int = 0
    host_hit_tokens: int = 0  # of hit_tokens, restored from the host tier
    host_evictions: int = 0  # entries dropped from the host tier: gone for good


class _LRUIndex:
    """Entries by key, least recently used first, with how many entries have each length (lookup tries those)."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple, CachedPrefix | HostPrefix] = OrderedDict()
        self.lengths: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: tuple, tokens: list[int]):
        """The entry of exactly these tokens (now the most recently used), or None."""
        entry = self.entries.get(key)
        if entry is not None and entry.tokens == tokens:
            self.entries.move_to_end(key)
            return entry
        return None

    def add(self, key: tuple, entry):
        """Adds `entry` as the most recently used; returns the entry it displaced (other tokens under the same key:
        a hash collision), now out of the index, for the caller to free, or None."""
        displaced = self._remove(key) if key in self.entries else None
        self.entries[key] = entry
        self.lengths[entry.length] = self.lengths.get(entry.length, 0) + 1
        return displaced

    def pop_oldest(self) -> tuple[tuple, CachedPrefix | HostPrefix]:
        key = next(iter(self.entries))
        return key, self._remove(key)

    def _remove(self, key: tuple):
        entry = self.entries.pop(key)
        self.lengths[entry.length] -= 1
        if not self.lengths[entry.length]:
            del self.lengths[entry.length]
        return entry

    def holds(self, entry) -> bool:
        return any(e is entry for e in self.entries.values())


class PrefixCache:
    def __init__(self, slots: SlotAllocator, blocks: BlockAllocator, max_entries: int, interval: int,
                 copy_state: Callable[[int, int], None], copy_block: Callable[[int, int], None],
                 host: PrefixHostTier | None = None):
        """copy_state(src_slot, dst_slot) and copy_block(src, dst) are the device copies (the pools'). host: the
        host tier evicted entries go to (None: they are dropped)."""
        self.slots, self.blocks = slots, blocks
        self.max_entries, self.interval = max_entries, interval
        self._copy_state, self._copy_block = copy_state, copy_block
        self._device = _LRUIndex()
        self.host = host
        self._host = _LRUIndex()
        self._serial = 0
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        """Entries on the device."""
        return len(self._device)

    @property
    def host_entries(self) -> int:
        return len(self._host)

    @property
    def host_bytes(self) -> int:
        return self.host.nbytes if self.host is not None else 0

    # -- keys ---------------------------------------------------------------------------------------------------
    def _chain(self, tokens: list[int], full_blocks: int) -> list[int]:
        bs = self.blocks.block_size
        chain = [0]
        for k in range(full_blocks):
            chain.append(hash((chain[-1], tuple(tokens[k * bs:(k + 1) * bs]))))
        return chain

    def _key(self, tokens: list[int], length: int, chain: list[int]) -> tuple:
        full = length // self.blocks.block_size
        return length, chain[full], tuple(tokens[full * self.blocks.block_size:length])

    # -- lookup and restore ----------------------------------------------------------------------------------------
    def lookup(self, prompt: list[int]) -> CachedPrefix | HostPrefix | None:
        """The longest entry whose tokens begin the prompt, a device one before a host one of the same length (now
        the most recently used of its tier), or None."""
        lengths = sorted({n for n in (*self._device.lengths, *self._host.lengths) if n <= len(prompt)}, reverse=True)
        if not lengths:
            return None
        chain = self._chain(prompt, lengths[0] // self.blocks.block_size)
        for n in lengths:
            key = self._key(prompt, n, chain)
            entry = self._device.get(key, prompt[:n]) or self._host.get(key, prompt[:n])
            if entry is not None:
                return entry
        return None

    def holds(self, entry: CachedPrefix | HostPrefix) -> bool:
        return self._device.holds(entry) or self._host.holds(entry)

    def shared_blocks(self, entry: CachedPrefix | HostPrefix) -> int:
        """KV blocks a sequence restoring `entry` shares instead of taking: a device entry's full blocks; none of a
        host entry's (they are copied into fresh blocks)."""
        return 0 if isinstance(entry, HostPrefix) else entry.length // self.blocks.block_size

    def count_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.stats.queried_tokens += prompt_tokens
        self.stats.hit_tokens += hit_tokens

    def restore(self, entry: CachedPrefix | HostPrefix, owner: str, slot: int) -> torch.Tensor:
        """Gives `owner` (a sequence holding the fresh state slot `slot` and no blocks) the entry's prefix: its KDA
        state copied into the slot; a device entry's full blocks shared and its last partial block copied into a
        block of the owner's, a host entry's blocks all copied into fresh ones. Returns the entry's logits row, on
        the device."""
        if isinstance(entry, HostPrefix):
            self.stats.host_hit_tokens += entry.length
            return self.host.load(entry, owner, slot)
        bs = self.blocks.block_size
        full = entry.length // bs
        table = self.blocks.table(entry.owner)
        self.blocks.share(owner, table[:full])
        if entry.length % bs:
            (block,) = self.blocks.reserve(owner, (full + 1) * bs)
            self._copy_block(table[full], block)
        self._copy_state(entry.slot, slot)
        return entry.logits

    # -- inserting ---------------------------------------------------------------------------------------------------
    def snapshot(self, tokens: list[int], slot: int, owner: str, logits: torch.Tensor) -> bool:
        """An entry for `tokens` (a running sequence's first len(tokens) tokens, with its state in `slot` and its KV
        in `owner`'s table): the state copied into an entry slot, the blocks shared. False when no slot is free."""
        if self._touch(tokens):
            return True
        if not self._make_room_for_one(needs_slot=True):
            return False
        entry_slot = self.slots.allocate(self._next_owner())
        self._copy_state(slot, entry_slot)
        self._add(tokens, entry_slot, owner, logits)
        return True

    def adopt(self, tokens: list[int], slot: int, owner: str, logits: torch.Tensor) -> bool:
        """As snapshot, for a finished sequence: its slot becomes the entry's (no copy). False (the caller frees
        the slot) when the tokens are cached already or no entry can be made room for."""
        if self._touch(tokens) or not self._make_room_for_one(needs_slot=False):
            return False
        self._add(tokens, slot, owner, logits)
        return True

    def _full_key(self, tokens: list[int]) -> tuple:
        return self._key(tokens, len(tokens), self._chain(tokens, len(tokens) // self.blocks.block_size))

    def _touch(self, tokens: list[int]) -> bool:
        """Whether the device holds these tokens already (then most recently used). A host entry of them does not
        count: a device entry restores faster, and evicting it later refreshes the host one."""
        return self._device.get(self._full_key(tokens), tokens) is not None

    def _make_room_for_one(self, needs_slot: bool) -> bool:
        """Evicts until an entry may be added (and, for a copy, a state slot is free). False if it cannot be."""
        if self.max_entries < 1:
            return False
        while len(self._device) >= self.max_entries or (needs_slot and not self.slots.num_free):
            if not self.evict_one():
                return False
        return True

    def _next_owner(self) -> str:
        self._serial += 1
        return f"<prefix-cache {self._serial}>"

    def _add(self, tokens: list[int], slot: int, owner: str, logits: torch.Tensor) -> None:
        entry_owner = self._next_owner()
        self.blocks.share(entry_owner, self.blocks.table(owner)[:self.blocks.blocks_for(len(tokens))], cache=True)
        entry = CachedPrefix(list(tokens), slot, entry_owner, logits.detach().float().clone())
        displaced = self._device.add(self._full_key(tokens), entry)
        if displaced is not None:
            self._free(displaced)
        self.stats.inserted += 1

    def _free(self, entry: CachedPrefix) -> None:
        """A device entry already out of the index: its slot and blocks back to the pools."""
        self.slots.free(entry.slot)
        self.blocks.release(entry.owner)

    # -- eviction ----------------------------------------------------------------------------------------------------
    def evict_one(self) -> bool:
        """Evicts the least recently used device entry (out of the index first, then its slot and blocks), copying
        it to the host tier when there is one. False if the device holds none."""
        if not self._device:
            return False
        key, entry = self._device.pop_oldest()
        if self.host is not None:
            self._to_host(key, entry)
        self._free(entry)
        self.stats.evictions += 1
        return True

    def _to_host(self, key: tuple, entry: CachedPrefix) -> None:
        """The host copy of an entry leaving the device (a host entry of the same tokens is only refreshed); the
        host tier's least recently used entry is dropped for good when it is full."""
        if self._host.get(key, entry.tokens) is not None:
            return
        while len(self._host) >= self.host.max_entries:
            _, old = self._host.pop_oldest()
            self.host.dropped(old)
            self.stats.host_evictions += 1
        saved = self.host.save(entry.tokens, entry.slot, self.blocks.table(entry.owner), entry.logits)
        displaced = self._host.add(key, saved)
        if displaced is not None:
            self.host.dropped(displaced)
        log.debug("prefix moved to host", extra={"tokens": entry.length, "host_entries": len(self._host),
                                                 "host_bytes": self.host.nbytes})

    def clear(self) -> None:
        """Drops every entry of both tiers; nothing is copied."""
        while self._device:
            self._free(self._device.pop_oldest()[1])
        while self._host:
            self.host.dropped(self._host.pop_oldest()[1])

    @property
    def blocks_held(self) -> int:
        """Blocks only the cache holds: what evicting every entry would free."""
        return self.blocks.num_cache_only
