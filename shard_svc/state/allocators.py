"""Pure-Python slot and block accounting (no tensors): which slot or block belongs to whom."""

from __future__ import annotations

from shard_svc.errors import KVBlocksExhausted, StateSlotsExhausted


class SlotAllocator:
    """Fixed set of state slots; one per live sequence."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, owner: str) -> int:
        if not self._free:
            raise StateSlotsExhausted(f"all {self.num_slots} KDA state slots are in use; cannot admit {owner!r}")
        slot = self._free.pop()
        self._owner[slot] = owner
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._owner:
            raise ValueError(f"state slot {slot} is not allocated")
        del self._owner[slot]
        self._free.append(slot)


class BlockAllocator:
    """Fixed pool of KV blocks of `block_size` tokens; a sequence's blocks form its block table.

    A block may be in several tables (the prefix cache shares full blocks of a cached prefix with the sequences
    that restore it): each block counts its tables, and it is free again only when the last one releases it.
    Tables of cache owners are told apart, so the blocks only the cache holds (what evicting it would free) are
    counted as they change, not by a walk over every table."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._refs: dict[int, int] = {}
        self._cache_refs: dict[int, int] = {}
        self._cache_owners: set[str] = set()
        self.num_cache_only = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, owner: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(owner, ())))

    def reserve(self, owner: str, num_tokens: int) -> list[int]:
        """Grow `owner`'s table to hold `num_tokens`; returns the newly added block ids."""
        need = self.extra_blocks_needed(owner, num_tokens)
        if need > len(self._free):
            raise KVBlocksExhausted(
                f"{owner!r} needs {need} more KV blocks for {num_tokens} tokens; {len(self._free)} of "
                f"{self.num_blocks} free"
            )
        new = [self._free.pop() for _ in range(need)]
        for block in new:
            self._count(block, +1, owner)
        self._tables.setdefault(owner, []).extend(new)
        return new

    def share(self, owner: str, blocks: list[int], cache: bool = False) -> None:
        """Appends blocks another table holds to `owner`'s table (the caller never writes into them). cache: the
        owner is a prefix cache entry."""
        if cache:
            self._cache_owners.add(owner)
        for block in blocks:
            if self._refs.get(block, 0) < 1:
                raise ValueError(f"KV block {block} is free; {owner!r} cannot share it")
            self._count(block, +1, owner)
        self._tables.setdefault(owner, []).extend(blocks)

    def table(self, owner: str) -> list[int]:
        return self._tables.get(owner, [])

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def release(self, owner: str) -> None:
        for block in reversed(self._tables.pop(owner, [])):
            self._count(block, -1, owner)
            if not self._refs[block]:
                del self._refs[block]
                self._free.append(block)
        self._cache_owners.discard(owner)

    def _count(self, block: int, delta: int, owner: str) -> None:
        was = self._cache_only(block)
        self._refs[block] = self._refs.get(block, 0) + delta
        if owner in self._cache_owners:
            self._cache_refs[block] = self._cache_refs.get(block, 0) + delta
            if not self._cache_refs[block]:
                del self._cache_refs[block]
        self.num_cache_only += self._cache_only(block) - was

    def _cache_only(self, block: int) -> bool:
        return self._refs.get(block, 0) > 0 and self._refs.get(block) == self._cache_refs.get(block, 0)
