"""Failing a sequence over to another shard by continuation, within a bound.

When a sequence's shard goes away mid-stream (router/shard_client.py ShardLost), the router holds all it needs to go
on elsewhere: the original Submit and every token id it has passed on. The continuation is the prompt plus those
tokens, marked as `prior_output_tokens` so the shard treats them as output (grammar, penalties, token indices, usage:
protos/kimiserve/v1/shard.proto), with the budget left and the same sampling, seed included (the router fixes an
unseeded sampled request's seed before its first leg, so the continuation draws what the original would have).
The text side (detokenizer, stop strings) never left the router, so the client's stream goes on with no gap and no
repeated token. Each leg runs under its own shard-side id (`<request id>/failover-<n>`), so a leg can never collide
with a previous one still being cleaned up on a shard that comes back. Router replicas share the shards but each
knows only its own live ids: a leg a shard refuses as already live (another replica's sequence holds the id) is sent
again under a random alias (`Legs.renamed`), so clients of different replicas may choose the same ids.

A draining shard hands its sequences over instead (ShardMoved, shard_svc/engine/handoff.py): the continuation is
the same, and the moved state is relayed from the draining shard to the next one (`relay_state`) and restored
there, so the continuation prefills only what the state does not hold (one token, for a decoding sequence). When
there is no state, or the relay fails, the next shard recomputes, as after a loss. A planned move does not count
against the bound: a rolling restart of many shards may move a stream once per shard.

One task (Generation._stream) reads a sequence's events and fails it over, one leg at a time, so a sequence never
fails over twice at once; each leg has its own event queue, and the shard client forgets a lost leg's id before it
says the leg is lost, so nothing of an old leg can reach the sequence once it has moved.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from kimiserve.v1 import shard_pb2
from router.errors import AlreadyExists, ShardLost, ShardMoved, ShardUnavailable

log = logging.getLogger(__name__)
MAX_RENAMES = 2


class FailoverRefused(ShardUnavailable):
    """The sequence cannot fail over again (its bound is spent, or it no longer fits any shard): its stream fails.
    `why` labels the metric of streams failed despite failover."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


@dataclass
class Legs:
    """One sequence's legs: the shard each ran on and its shard-side id."""

    request_id: str
    first: shard_pb2.ShardRequest.Submit  # the first leg's Submit: the original prompt and budget
    max_failovers: int
    shards: list[str] = field(default_factory=list)  # the shard of each leg so far, in order
    failovers: int = 0  # legs that began because a shard was lost (a planned move is not counted)
    current: shard_pb2.ShardRequest.Submit | None = None  # the Submit of the leg last placed
    alias: str = ""  # added to every leg's id after a shard refused one as already live (`renamed`)
    renames: int = 0

    @property
    def moves(self) -> int:
        """Legs after the first, lost or moved."""
        return max(len(self.shards) - 1, 0)

    @property
    def leg_id(self) -> str:
        """The current leg's id on its shard."""
        base = self.request_id + self.alias
        return base if self.moves == 0 else f"{base}/failover-{self.moves}"

    def renamed(self, shard: str, message: str) -> None:
        """The current leg's shard refused its id as already live there: a sequence of another router replica (each
        knows only its own live ids) runs under it. The leg is sent again under a random alias, which no router's
        ids take (theirs are client ids and `~k` aliases); a clash under such an alias is not chance, so after
        MAX_RENAMES the request fails, naming the ids."""
        if self.renames >= MAX_RENAMES:
            raise AlreadyExists(f"request {self.request_id!r}: shard {shard} refused its id {self.leg_id!r} as "
                                f"already live {self.renames + 1} times, under fresh random aliases too: {message}")
        self.renames += 1
        self.alias = f"~r{secrets.token_hex(6)}"
        self.shards.pop()  # the refused leg never ran

    def continuation(self, lost: ShardLost, generated: list[int], max_context: int) -> shard_pb2.ShardRequest.Submit:
        """The Submit that continues the sequence after `generated` (every token id passed on so far), counted as a
        failover unless it is a planned move; or FailoverRefused naming the request, the shards tried and the
        sizes."""
        tried = ", ".join(self.shards)
        if not isinstance(lost, ShardMoved) and self.failovers >= self.max_failovers:
            raise FailoverRefused(f"request {self.request_id!r} failed: its shard {lost.shard} was lost "
                                  f"({lost.reason}) after {len(generated)} tokens, and it has already failed over "
                                  f"{self.failovers} times (--max-failovers {self.max_failovers}); shards tried: "
                                  f"{tried}", "bound")
        prompt = list(self.first.prompt_token_ids)
        left = self.first.max_tokens - len(generated)
        total = len(prompt) + len(generated) + left
        if total > max_context:
            raise FailoverRefused(f"request {self.request_id!r} cannot fail over from shard {lost.shard} "
                                  f"({lost.reason}): its continuation of {len(prompt)} prompt + {len(generated)} "
                                  f"generated + {left} remaining = {total} tokens exceeds the maximum context of "
                                  f"{max_context} tokens the shards now hold; shards tried: {tried}", "context")
        sub = shard_pb2.ShardRequest.Submit()
        sub.CopyFrom(self.first)
        sub.ClearField("trace_context")  # each leg hangs under the stream span it is sent from
        sub.prompt_token_ids.extend(generated)
        sub.max_tokens = left
        sub.prior_output_tokens = len(generated)
        sub.sampling.min_tokens = max(0, self.first.sampling.min_tokens - len(generated))  # the first leg's count
        sub.sampling.ClearField("prompt_logprobs")  # the first leg sent the scored prompt
        if not isinstance(lost, ShardMoved):
            self.failovers += 1
        return sub


async def relay_state(source, target, from_id: str, to_id: str, timeout_s: float) -> int:
    """Moves a state the draining `source` holds under `from_id` (its Moved event's leg) to `target` under `to_id`
    (the next leg's id); returns the tokens it holds. Raises the gRPC error of either side."""
    async def renamed():
        async for chunk in source.export_state(from_id, timeout_s):
            if chunk.WhichOneof("kind") == "header":
                chunk.header.request_id = to_id
            yield chunk

    reply = await target.import_state(renamed(), timeout_s)
    return reply.tokens
