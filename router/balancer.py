"""Shard choice: prefix affinity balanced against headroom. Pure Python; the shard clients feed it.

Headroom is the shard's free state slots minus its queue, from its last Load answer, minus the sequences this router
sent it since it asked for that answer that still run, so a burst between two polls spreads instead of piling onto one
shard, and short sequences that already finished do not make an idle shard look full.

Prefix affinity: each shard keeps its own prefix cache, so prompts that start alike (the turns of one conversation,
requests sharing a system prompt) should meet on one shard. The router's PrefixIndex says how many leading tokens of
this prompt each shard has already been sent; the shard with the longest match is taken while its headroom is within
AFFINITY_SLACK of the best, else the one with the most headroom, so affinity never queues a request behind a busy
shard while another is free. A prompt no shard has seen goes to the one with the most headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def pick_shard(views: list[ShardView], matched: dict[str, int] | None = None) -> ShardView:
    """matched: leading prompt tokens each shard has seen (PrefixIndex.matched_tokens); None or {} for no affinity."""
    healthy = [v for v in views if v.healthy]
    if not healthy:
        raise NoHealthyShard(f"no healthy shard among {[v.name for v in views]}")
    # Ties go to the shard with fewer in-flight requests, then by name for determinism.
    roomiest = max(healthy, key=lambda v: (v.headroom, -v.in_flight, v.name))
    warm = [v for v in healthy if matched and matched.get(v.name, 0) > 0]
    if not warm:
        return roomiest
    preferred = max(warm, key=lambda v: (matched[v.name], v.headroom, -v.in_flight, v.name))
    if preferred.headroom > 0 and preferred.headroom >= roomiest.headroom - AFFINITY_SLACK:
        return preferred
    return roomiest
