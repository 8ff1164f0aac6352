"""Hybrid prefix cache: a request restores the longest cached prefix of its prompt and prefills only the rest.

What a prefix of L tokens needs to be skipped: the MLA latent KV of positions [0, L) and the KDA recurrent + conv
state after L tokens (K3's block attention residuals mix layer outputs of one position, so they carry nothing across
positions). The KV is paged: an entry shares the full blocks of its prefix by reference count (block_size tokens
each, never written again, since a sequence writes only positions past its own cached length), plus its last,
partly filled block, which a restoring sequence copies into a block of its own before writing after it. The KDA
state is fixed-size per sequence (about 41 MiB at the 48B shape), so an entry holds one whole state slot of the
KDA pool: a slot of its own, in the slots the pool holds beyond the running sequences. With every entry also goes
the logits row of its last position, so a prompt that is cached whole samples its first token without a pass.

Snapshot points of a prompt (entries are copies of the state there):
(1) where its chat messages end (PrefixHints.boundaries: the tokenizer reports them, the router passes them on;
    `message_points` keeps at most MAX_MESSAGE_POINTS of them, each MIN_MESSAGE_GAP tokens past the one before),
    each moved down to a multiple of CHUNK_ALIGN (of every KDA chunk size): a pass cut there computes every chunk as
    the uncut pass does, so taking the point changes no bit of the prompt's own output, and a request restoring it
    prefills the rest on the grid an uncached one uses (in bf16 a cut between grid lines regroups the sums of the
    chunks after it, enough to flip a near-tied token; under CHUNK_ALIGN shared tokens fewer are restored),
(2) every `interval` tokens (a multiple of the KV block size, so no partial block) up to 16 x interval, then twice as
    far apart with every doubling of the position (`interval_step`: O(log L) points in a prompt of L tokens), and
(3) the prompt's end.
A point inside a pass's chunk of the prompt (`points_inside`) is written out by that pass: the engine claims an
entry slot for it before the pass (`claim`), the KDA layers write the recurrent and conv states at the point into it
(ops/kda/snapshots.py: the kernels cut the sequence there and carry its state on), the runner computes the
logits row before it, and the entry is made after the pass (`add_claimed`). So points cost no extra pass and do not
shorten the sequence's chunk. A point where a pass ends is copied from the sequence's slot after the pass
(`snapshot`). (4) When a sequence finishes normally its slot is handed over instead of freed (no copy), covering
prompt + output, so the next turn of the conversation hits.

Lookup hashes the prompt block by block (a chain: each block's hash covers every block before it, seeded by the
request's salt), then tries the entry lengths longest first (on the device, then on the host), comparing the salt and
the whole token list on a hash hit: a collision can never restore another prompt's state, and a request never
restores an entry made under another salt (two prompts under one key: the newer entry displaces the older, whose slot
and blocks are freed). So a request that shares any snapshot point's prefix with a cached prompt restores it.

Memory: the device holds at most `max_entries` entries, each one state slot (allocated with the pool at startup, so
`max_entries` x the slot's bytes is the bound) plus KV blocks that admissions reclaim when they need them. Which
entries stay is decided by value (GreedyDual-Size-Frequency with every entry one slot): an entry's priority is the
index's clock + (1 + its hits) x its length (tokens a hit saves); the lowest goes first and the clock rises to its
priority, so entries nobody restores age out however long they are, and a restored or re-made entry is refreshed.
With a host tier (shard_svc/engine/prefix_host.py, `--prefix-host-entries`) an evicted entry is copied to host memory
instead of dropped, under the same policy and its own entry bound, and a hit there is copied back into the restoring
sequence. An entry leaves the index before its slot and blocks are freed, so an evicted snapshot cannot be read.

Every decision depends only on the token lists, salts and counts, never on byte sizes or timing (hash() of int
tuples is not salted per process, and the salt enters as a blake2b digest), so every rank of a shard group makes the
same ones.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from shard_svc.engine.prefill_share import CHUNK_ALIGN
from shard_svc.engine.prefix_host import HostPrefix, PrefixHostTier
from shard_svc.engine.sequence import Sequence
from shard_svc.errors import InvalidRequest
from shard_svc.state.allocators import BlockAllocator, SlotAllocator

log = logging.getLogger(__name__)

# Message boundaries a request may send (the router's message limit) and how many of them become snapshot points:
# the first ones (system prompt, tool declarations: what many requests share) and the last ones (the turns just
# before the new message), each at least MIN_MESSAGE_GAP tokens past the previous point, so a chat of many short
# turns neither splits its prefill into many short passes nor floods the cache. The last message's end is dropped
# when it is within MIN_MESSAGE_GAP of the prompt's end.
MAX_BOUNDARIES = 4096
MAX_MESSAGE_POINTS = 4
MIN_MESSAGE_GAP = 64

# Interval points: the first DENSE_INTERVALS are `interval` apart, then the spacing doubles with every doubling of the
# position (`interval_step`).
DENSE_INTERVALS = 16
# The shard's default interval (rounded up to a multiple of the KV block size). A point costs a state copy inside the
# pass, not a pass, so the spacing is set by which partial shares should restore: 2,000 shared tokens of a cached
# 3,000-token prompt restore 1,024. The extra short entries a finer spacing makes are the first value-based eviction
# drops.
DEFAULT_PREFIX_STATE_INTERVAL = 1024

SNAPSHOT_KINDS = ("prompt_end", "message", "interval", "finish")


def salt_seed(salt: str) -> int:
    """The block chain's seed for a salt: 0 for none; else 8 bytes of its blake2b digest (the same in every
    process, unlike hash() of a str)."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little") if salt else 0


@dataclass
class CachedPrefix:
    tokens: list[int]
    slot: int
    owner: str  # its block table's owner in the allocator
    logits: torch.Tensor  # fp32 [vocab]: the model's logits at position len(tokens) - 1
    salt: str = ""
    hits: int = 0  # sequences that restored it (carried to its host copy)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0  # restored from either tier
    evictions: int = 0  # entries that left the device (to the host tier when it is on)
    inserted: int = 0  # entries made, of every kind below
    host_hit_tokens: int = 0  # of hit_tokens, restored from the host tier
    host_evictions: int = 0  # entries dropped from the host tier: gone for good
    snapshots_prompt_end: int = 0  # entries made by kind (SNAPSHOT_KINDS); finish: a finished sequence's slot
    snapshots_message: int = 0
    snapshots_interval: int = 0
    snapshots_finish: int = 0


class _ValueIndex:
    """Entries by key, each with its priority (GreedyDual-Size-Frequency, every entry the same size): the lowest is
    evicted first, ties by least recently used; with how many entries have each length (lookup tries those)."""

    def __init__(self) -> None:
        self.entries: dict[tuple, CachedPrefix | HostPrefix] = {}
        self.lengths: dict[int, int] = {}
        self._rank: dict[tuple, tuple[int, int]] = {}  # key -> (priority, last use)
        self._uses = 0
        self.clock = 0  # the priority of the last evicted entry: new and refreshed priorities start from it

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: tuple, salt: str, tokens: list[int]):
        """The entry of exactly these tokens under this salt, or None. Changes nothing."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.salt == salt and entry.tokens == tokens else None

    def refresh(self, key: tuple) -> None:
        """The entry was used (looked up for a hit, or made again): its priority from the clock now."""
        entry = self.entries[key]
        self._uses += 1
        self._rank[key] = (self.clock + (1 + entry.hits) * entry.length, self._uses)

    def add(self, key: tuple, entry):
        """Adds `entry`, just used; returns the entry it displaced (other tokens or salt under the same key: a hash
        collision), now out of the index, for the caller to free, or None."""
        displaced = self._remove(key) if key in self.entries else None
        self.entries[key] = entry
        self.lengths[entry.length] = self.lengths.get(entry.length, 0) + 1
        self.refresh(key)
        return displaced

    def pop_least(self) -> tuple[tuple, CachedPrefix | HostPrefix]:
        key = min(self._rank, key=self._rank.__getitem__)
        self.clock = self._rank[key][0]
        return key, self._remove(key)

    def pop_any(self) -> tuple[tuple, CachedPrefix | HostPrefix]:
        key = next(iter(self.entries))
        return key, self._remove(key)

    def _remove(self, key: tuple):
        entry = self.entries.pop(key)
        del self._rank[key]
        self.lengths[entry.length] -= 1
        if not self.lengths[entry.length]:
            del self.lengths[entry.length]
        return entry

    def key_of(self, entry) -> tuple | None:
        return next((k for k, e in self.entries.items() if e is entry), None)


class PrefixCache:
    def __init__(self, slots: SlotAllocator, blocks: BlockAllocator, max_entries: int, interval: int,
                 copy_state: Callable[[int, int], None], copy_block: Callable[[int, int], None],
                 host: PrefixHostTier | None = None):
        """copy_state(src_slot, dst_slot) and copy_block(src, dst) are the device copies (the pools'). interval:
        snapshot every this many prompt tokens (0: never; else a multiple of the block size). host: the host tier
        evicted entries go to (None: they are dropped)."""
        if interval < 0 or interval % blocks.block_size:
            raise ValueError(f"prefix state interval {interval} must be >= 0 and a multiple of the KV block size "
                             f"{blocks.block_size}")
        self.slots, self.blocks = slots, blocks
        self.max_entries, self.interval = max_entries, interval
        self._copy_state, self._copy_block = copy_state, copy_block
        self._device = _ValueIndex()
        self.host = host
        self._host = _ValueIndex()
        self._serial = 0
        self._claimed = 0  # slots claimed for entries a running pass is writing (they count against max_entries)
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

    # -- snapshot points ---------------------------------------------------------------------------------------------
    @staticmethod
    def message_points(request_id: str, boundaries: list[int], prompt_len: int) -> tuple[int, ...]:
        """The message boundaries a request sent that become snapshot points (module docstring). Raises
        InvalidRequest for boundaries that are not increasing offsets inside the prompt."""
        if len(boundaries) > MAX_BOUNDARIES:
            raise InvalidRequest(f"request {request_id!r}: {len(boundaries)} message boundaries; at most "
                                 f"{MAX_BOUNDARIES}")
        previous = 0
        for b in boundaries:
            if not previous < b < prompt_len:
                raise InvalidRequest(f"request {request_id!r}: message boundary {b} after {previous}: boundaries "
                                     f"must increase strictly within (0, {prompt_len}) (the prompt's length)")
            previous = b
        if boundaries and prompt_len - boundaries[-1] < MIN_MESSAGE_GAP:
            # The last message's end, just before the generation prompt: the prompt-end entry, made anyway, serves
            # the next turn as well (its rendering repeats the generation prompt).
            boundaries = boundaries[:-1]
        kept, last = [], 0
        for b in boundaries:
            b -= b % CHUNK_ALIGN  # on the kernels' chunk grid (module docstring, (1))
            if b - last >= MIN_MESSAGE_GAP:
                kept.append(b)
                last = b
        half = MAX_MESSAGE_POINTS // 2
        return tuple(kept if len(kept) <= MAX_MESSAGE_POINTS else kept[:half] + kept[-half:])

    def interval_step(self, position: int) -> int:
        """The spacing of interval points from `position` on: the interval below DENSE_INTERVALS x the interval,
        then doubling with every doubling of the position, so a prompt of L tokens has O(log L) points (each one an
        entry slot's copy) and a restored start keeps more than 1 - 1/DENSE_INTERVALS of what it shares (or
        all but less than one interval)."""
        step = self.interval
        while position >= step * DENSE_INTERVALS:
            step *= 2
        return step

    def points_inside(self, seq: Sequence, n: int) -> list[tuple[int, str]]:
        """The snapshot points strictly inside `seq`'s next n prompt tokens, (position, kind) in order: where its
        pass writes states out mid-sequence. The point where the pass ends, if it is one, is snapshot_kind's."""
        done = seq.num_computed
        end = min(done + n, len(seq.prompt))
        points = {b: "message" for b in seq.prefix.boundaries if done < b < end}
        p = done
        while self.interval:
            step = self.interval_step(p)  # every larger step's region starts on a multiple of this one
            p = (p // step + 1) * step
            if p >= end:
                break
            points.setdefault(p, "interval")
        return sorted(points.items())

    def snapshot_kind(self, seq: Sequence) -> str | None:
        """Which snapshot point `seq` stands on after a pass (SNAPSHOT_KINDS), or None."""
        done = seq.num_computed
        if done == len(seq.prompt):
            return "prompt_end"
        if done in seq.prefix.boundaries:
            return "message"
        if self.interval and done % self.interval_step(done) == 0:
            return "interval"
        return None

    # -- keys ---------------------------------------------------------------------------------------------------
    def _chain(self, tokens: list[int], full_blocks: int, salt: str) -> list[int]:
        bs = self.blocks.block_size
        chain = [salt_seed(salt)]
        for k in range(full_blocks):
            chain.append(hash((chain[-1], tuple(tokens[k * bs:(k + 1) * bs]))))
        return chain

    def _key(self, tokens: list[int], length: int, chain: list[int]) -> tuple:
        full = length // self.blocks.block_size
        return length, chain[full], tuple(tokens[full * self.blocks.block_size:length])

    # -- lookup and restore ----------------------------------------------------------------------------------------
    def lookup(self, prompt: list[int], salt: str = "") -> CachedPrefix | HostPrefix | None:
        """The longest entry made under `salt` whose tokens begin the prompt, a device one before a host one of the
        same length (now refreshed in its tier), or None."""
        lengths = sorted({n for n in (*self._device.lengths, *self._host.lengths) if n <= len(prompt)}, reverse=True)
        if not lengths:
            return None
        chain = self._chain(prompt, lengths[0] // self.blocks.block_size, salt)
        for n in lengths:
            key = self._key(prompt, n, chain)
            for index in (self._device, self._host):
                entry = index.get(key, salt, prompt[:n])
                if entry is not None:
                    index.refresh(key)
                    return entry
        return None

    def holds(self, entry: CachedPrefix | HostPrefix) -> bool:
        return self._device.key_of(entry) is not None or self._host.key_of(entry) is not None

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
        the device. The entry's hits count one more (its value)."""
        entry.hits += 1
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
    def snapshot(self, tokens: list[int], slot: int, owner: str, logits: torch.Tensor, salt: str = "",
                 kind: str = "prompt_end") -> bool:
        """An entry for `tokens` under `salt` (a running sequence's first len(tokens) tokens, with its state in
        `slot` and its KV in `owner`'s table): the state copied into an entry slot, the blocks shared. False when
        no slot can be made free. kind: which snapshot point it is (SNAPSHOT_KINDS), for the counters."""
        if self._touch(tokens, salt):
            return True
        if not self._make_room_for_one(needs_slot=True):
            return False
        entry_slot = self.slots.allocate(self._next_owner())
        self._copy_state(slot, entry_slot)
        self._add(tokens, entry_slot, owner, logits, salt, kind)
        return True

    def claim(self, tokens: list[int], salt: str) -> int | None:
        """A slot for the entry of `tokens` a pass is about to write (a snapshot point inside the pass): None when
        the device holds those tokens already (now refreshed) or no slot can be made free. After the pass,
        add_claimed makes the entry, or release gives the slot back."""
        if self._touch(tokens, salt) or not self._make_room_for_one(needs_slot=True):
            return None
        self._claimed += 1
        return self.slots.allocate(self._next_owner())

    def add_claimed(self, tokens: list[int], slot: int, owner: str, logits: torch.Tensor, salt: str,
                    kind: str) -> None:
        """The entry for a claimed slot, now holding the state after `tokens` (`owner`'s KV holds their blocks).
        Another sequence of the same pass may have cached the same tokens first: then the slot goes back."""
        self._claimed -= 1
        if self._touch(tokens, salt):
            self.slots.free(slot)
            return
        self._add(tokens, slot, owner, logits, salt, kind)

    def release(self, slot: int) -> None:
        """A claimed slot whose pass failed (or whose state is not to be kept)."""
        self._claimed -= 1
        self.slots.free(slot)

    def adopt(self, tokens: list[int], slot: int, owner: str, logits: torch.Tensor, salt: str = "") -> bool:
        """As snapshot, for a finished sequence: its slot becomes the entry's (no copy). False (the caller frees
        the slot) when the tokens are cached already or no entry can be made room for."""
        if self._touch(tokens, salt) or not self._make_room_for_one(needs_slot=False):
            return False
        self._add(tokens, slot, owner, logits, salt, "finish")
        return True

    def _full_key(self, tokens: list[int], salt: str) -> tuple:
        return self._key(tokens, len(tokens), self._chain(tokens, len(tokens) // self.blocks.block_size, salt))

    def _touch(self, tokens: list[int], salt: str) -> bool:
        """Whether the device holds these tokens already (then refreshed). A host entry of them does not count: a
        device entry restores faster, and evicting it later refreshes the host one."""
        key = self._full_key(tokens, salt)
        if self._device.get(key, salt, tokens) is None:
            return False
        self._device.refresh(key)
        return True

    def _make_room_for_one(self, needs_slot: bool) -> bool:
        """Evicts until an entry may be added (and, for a copy, a state slot is free). False if it cannot be."""
        if self.max_entries < 1:
            return False
        while len(self._device) + self._claimed >= self.max_entries or (needs_slot and not self.slots.num_free):
            if not self.evict_one():
                return False
        return True

    def _next_owner(self) -> str:
        self._serial += 1
        return f"<prefix-cache {self._serial}>"

    def _add(self, tokens: list[int], slot: int, owner: str, logits: torch.Tensor, salt: str, kind: str) -> None:
        entry_owner = self._next_owner()
        self.blocks.share(entry_owner, self.blocks.table(owner)[:self.blocks.blocks_for(len(tokens))], cache=True)
        entry = CachedPrefix(list(tokens), slot, entry_owner, logits.detach().float().clone(), salt)
        displaced = self._device.add(self._full_key(tokens, salt), entry)
        if displaced is not None:
            self._free(displaced)
        self.stats.inserted += 1
        name = f"snapshots_{kind}"
        setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _free(self, entry: CachedPrefix) -> None:
        """A device entry already out of the index: its slot and blocks back to the pools."""
        self.slots.free(entry.slot)
        self.blocks.release(entry.owner)

    # -- eviction ----------------------------------------------------------------------------------------------------
    def evict_one(self) -> bool:
        """Evicts the least valuable device entry (out of the index first, then its slot and blocks), copying it to
        the host tier when there is one. False if the device holds none."""
        if not self._device:
            return False
        key, entry = self._device.pop_least()
        if self.host is not None:
            self._to_host(key, entry)
        self._free(entry)
        self.stats.evictions += 1
        return True

    def _to_host(self, key: tuple, entry: CachedPrefix) -> None:
        """The host copy of an entry leaving the device, with its hits (a host entry of the same tokens is only
        refreshed); the host tier's least valuable entry is dropped for good when it is full."""
        if self._host.get(key, entry.salt, entry.tokens) is not None:
            self._host.refresh(key)
            return
        while len(self._host) >= self.host.max_entries:
            _, old = self._host.pop_least()
            self.host.dropped(old)
            self.stats.host_evictions += 1
        saved = self.host.save(entry.tokens, entry.slot, self.blocks.table(entry.owner), entry.logits)
        saved.salt, saved.hits = entry.salt, entry.hits
        displaced = self._host.add(key, saved)
        if displaced is not None:
            self.host.dropped(displaced)
        log.debug("prefix moved to host", extra={"tokens": entry.length, "host_entries": len(self._host),
                                                 "host_bytes": self.host.nbytes})

    def clear(self) -> None:
        """Drops every entry of both tiers; nothing is copied."""
        while self._device:
            self._free(self._device.pop_any()[1])
        while self._host:
            self.host.dropped(self._host.pop_any()[1])

    @property
    def blocks_held(self) -> int:
        """Blocks only the cache holds: what evicting every entry would free."""
        return self.blocks.num_cache_only
