"""Which prompt prefixes each shard has seen, so the next turn of a conversation goes where its prefix is cached.

Each shard keeps its own prefix cache (shard_svc/engine/prefix_cache.py); the router cannot see inside it, so it
remembers what it sent where. A prompt is cut into BLOCK-token blocks and each block is named by a hash chained over
every block before it (block i's name depends on tokens 0 .. (i+1)*BLOCK) and seeded by the request's cache salt
(router/cache_salt.py), so "shard s saw block i's name" means "shard s saw this whole prefix, under this salt": a
prompt follows only prefixes its shard can restore for it (the shard keys its entries by the same salt). A request
that shares only the start of an earlier prompt (a system prompt, a document's first pages) matches that start's
blocks, and goes where it can restore the longest snapshot the shard took inside them. Per shard, the names live in
an LRU bounded by `capacity_blocks`: the router's picture is approximate (a shard may have evicted what the router
remembers), which costs only a missed hit.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict

BLOCK = 16
DEFAULT_CAPACITY_BLOCKS = 1 << 16  # per shard: a million prompt tokens' names, 12 MiB when full (measured)


def block_names(prompt: list[int], salt: str = "") -> list[bytes]:
    """The chained name of every whole block of the prompt under `salt` (a trailing partial block is not named)."""
    ids = array("I", prompt)  # each id as 4 bytes, little-endian below (OverflowError for ids outside 32 bits)
    if sys.byteorder == "big":
        ids.byteswap()
    data, step = ids.tobytes(), 4 * BLOCK
    names, previous = [], salt.encode()
    for start in range(0, len(data) - step + 1, step):
        previous = hashlib.blake2b(previous + data[start:start + step], digest_size=16).digest()
        names.append(previous)
    return names


class PrefixIndex:
    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"prefix index capacity must be >= 1 block, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def matched_tokens(self, names: list[bytes]) -> dict[str, int]:
        """For each shard that has seen at least one block: how many leading prompt tokens it has seen."""
        out = {}
        for shard, seen in self._seen.items():
            n = 0
            while n < len(names) and names[n] in seen:
                n += 1
            if n:
                out[shard] = n * BLOCK
        return out

    def record(self, shard: str, names: list[bytes]) -> None:
        seen = self._seen.setdefault(shard, OrderedDict())
        for name in names:
            seen[name] = None
            seen.move_to_end(name)
        while len(seen) > self.capacity_blocks:
            seen.popitem(last=False)

    def forget(self, shard: str) -> None:
        self._seen.pop(shard, None)
