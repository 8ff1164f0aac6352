"""Shard choice: prefix affinity balanced against headroom. Pure Python; the shard clients feed it.

Headroom is the shard's free state slots minus its queue, from its last Load answer, minus what this router sent
it since that answer, so a burst between two polls spreads instead of piling onto one shard.

Prefix affinity: each shard keeps its own prefix cache, so prompts that start alike (the turns of one conversation,
requests sharing a system prompt) should meet on one shard. The first AFFINITY_TOKENS tokens pick a shard by
rendezvous hashing (the same shard for the same start, whatever the order of the list; a shard leaving moves only
its own prompts); that shard is taken while its headroom is within AFFINITY_SLACK of the best, else the one with
the most headroom, so affinity never queues a request behind a busy shard while another is free.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

AFFINITY_TOKENS = 256
AFFINITY_SLACK = 2


@dataclass
class ShardView:
    name: str
    healthy: bool = False
    free_slots: int = 0
    queued: int = 0
    sent_since_poll: int = 0
    in_flight: int = 0

    @property
    def headroom(self) -> int:
        return self.free_slots - self.queued - self.sent_since_poll


class NoHealthyShard(Exception):
    """Every shard is down or out of rotation."""


def affinity_key(prompt: list[int]) -> bytes:
    """What prefix affinity hashes: the prompt's first AFFINITY_TOKENS ids."""
    return b"".join(t.to_bytes(4, "little") for t in prompt[:AFFINITY_TOKENS])


def _rendezvous(key: bytes, name: str) -> bytes:
    return hashlib.blake2b(key + b"|" + name.encode(), digest_size=8).digest()


def pick_shard(views: list[ShardView], key: bytes | None = None) -> ShardView:
    healthy = [v for v in views if v.healthy]
    if not healthy:
        raise NoHealthyShard(f"no healthy shard among {[v.name for v in views]}")
    # Ties go to the shard with fewer in-flight requests, then by name for determinism.
    roomiest = max(healthy, key=lambda v: (v.headroom, -v.in_flight, v.name))
    if key is None:
        return roomiest
    preferred = max(healthy, key=lambda v: _rendezvous(key, v.name))
    if preferred.headroom > 0 and preferred.headroom >= roomiest.headroom - AFFINITY_SLACK:
        return preferred
    return roomiest
