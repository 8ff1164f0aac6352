"""Shard choice: the healthy shard with the most headroom. Pure Python; the shard clients feed it.

Headroom is the shard's free state slots minus its queue, from its last Load answer, minus what this router sent
it since that answer, so a burst between two polls spreads instead of piling onto one shard.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def pick_shard(views: list[ShardView]) -> ShardView:
    healthy = [v for v in views if v.healthy]
    if not healthy:
        raise NoHealthyShard(f"no healthy shard among {[v.name for v in views]}")
    # Ties go to the shard with fewer in-flight requests, then by name for determinism.
    return max(healthy, key=lambda v: (v.headroom, -v.in_flight, v.name))
