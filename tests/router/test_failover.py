"""Failover's bounds, its race and a drained shard's rotation, against the router's own code.

- A continuation carries the prompt plus the tokens passed on, as prior_output_tokens, with the budget left, and every
  leg has its own shard-side id; past --max-failovers, or when it no longer fits, it is refused with a message
  naming the request, the shards tried, the count and the sizes.
- The race: a hung shard leaves rotation (its probes fail) while its stream is still open, and its last token
  arrives after that. The sequence has been told it lost its shard (ShardLost, once) and the late token never reaches
  it, so the continuation and the old shard can never both deliver a token. The shard is a scripted gRPC server on
  localhost: real gRPC, the router's real ShardClient.
- A shard that sends Moved (it drains and hands its sequences over) leaves rotation at once and stays out, even while
  a probe still answers SERVING, until its stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kimiserve.v1 import common_pb2, shard_pb2, shard_pb2_grpc
from router.errors import ShardLost, ShardMoved
from router.failover import FailoverRefused, Legs
from router.shard_client import PROBES_TO_FAIL, ShardClient

FIRST = shard_pb2.ShardRequest.Submit(request_id="req-1", prompt_token_ids=[5, 6, 7], max_tokens=10,
                                      sampling=common_pb2.SamplingParams(temperature=1.0, seed=9, prompt_logprobs=2,
                                                                         min_tokens=5))
LOST = ShardLost("10.0.0.1:7000", "stream broke: UNAVAILABLE", "stream_broke")


def test_a_continuation_resends_the_tokens_passed_on_as_continued_output():
    legs = Legs("req-1", FIRST, max_failovers=2, shards=["a:1"])
    sub = legs.continuation(LOST, [40, 41, 42], max_context=64)
    assert list(sub.prompt_token_ids) == [5, 6, 7, 40, 41, 42]
    assert (sub.prior_output_tokens, sub.max_tokens, sub.sampling.seed) == (3, 7, 9)
    assert sub.sampling.min_tokens == 2, "the tokens passed on count toward min_tokens"
    assert legs.continuation(LOST, list(range(40, 47)), max_context=64).sampling.min_tokens == 0
    assert not sub.sampling.HasField("prompt_logprobs"), "the first leg sent the scored prompt"
    assert list(FIRST.prompt_token_ids) == [5, 6, 7], "the first Submit is left as it was"
    legs.shards.append("b:1")
    assert legs.leg_id == "req-1/failover-1"


def test_past_the_bound_the_stream_fails_naming_the_request_the_shards_and_the_count():
    legs = Legs("req-1", FIRST, max_failovers=2, shards=["a:1", "b:1", "a:1"], failovers=2)
    with pytest.raises(FailoverRefused) as e:
        legs.continuation(LOST, [40], max_context=64)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.why == "bound"
    assert all(s in str(e.value) for s in ("'req-1'", "already failed over 2 times", "--max-failovers 2",
                                           "a:1, b:1, a:1"))


def test_a_planned_move_neither_counts_against_the_bound_nor_is_refused_by_it():
    legs = Legs("req-1", FIRST, max_failovers=1, shards=["a:1"])
    moved = ShardMoved("a:1", "req-1", computed_tokens=5, state_bytes=1000)
    for shard in ("b:1", "a:1", "b:1"):  # a rolling restart of several shards may move a stream once per shard
        sub = legs.continuation(moved, [40], max_context=64)
        legs.shards.append(shard)
    assert (legs.failovers, legs.moves, legs.leg_id) == (0, 3, "req-1/failover-3")
    assert list(sub.prompt_token_ids) == [5, 6, 7, 40] and sub.prior_output_tokens == 1
    legs.continuation(LOST, [40], max_context=64)  # the first loss is within the bound of 1
    with pytest.raises(FailoverRefused, match="already failed over 1 times"):
        legs.continuation(LOST, [40], max_context=64)


def test_a_continuation_that_fits_no_shard_fails_naming_the_sizes():
    legs = Legs("req-1", FIRST, max_failovers=2, shards=["a:1"])
    with pytest.raises(FailoverRefused, match=r"'req-1'.*3 prompt \+ 4 generated \+ 6 remaining = 13 tokens exceeds "
                                              r"the maximum context of 12 tokens") as e:
        legs.continuation(LOST, [1, 2, 3, 4], max_context=12)
    assert e.value.why == "context"


class HungShard(shard_pb2_grpc.ShardServicer, health_pb2_grpc.HealthServicer):
    """Streams two tokens of each sequence, then holds the third until `release` is set; its probes answer until
    `hang` is set, then time out (a shard that stopped answering with its stream still open)."""

    def __init__(self):
        self.hang, self.release = asyncio.Event(), asyncio.Event()

    async def Stream(self, request_iterator, context):
        request = await request_iterator.__anext__()
        rid = request.submit.request_id
        for i in range(2):
            yield shard_pb2.ShardEvent(request_id=rid, token=shard_pb2.ShardEvent.Token(token_id=100 + i, index=i))
        await self.release.wait()
        yield shard_pb2.ShardEvent(request_id=rid, token=shard_pb2.ShardEvent.Token(token_id=102, index=2))
        await asyncio.sleep(30)

    async def _answer(self, reply):
        if self.hang.is_set():
            await asyncio.sleep(30)
        return reply

    async def Check(self, request, context):
        return await self._answer(health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING))

    async def Health(self, request, context):
        return await self._answer(shard_pb2.ShardHealthResponse())

    async def Info(self, request, context):
        return shard_pb2.ShardInfoResponse(model_name="scripted")

    async def Load(self, request, context):
        return await self._answer(shard_pb2.ShardLoadResponse(free_state_slots=4))


@contextlib.asynccontextmanager
async def scripted(shard):
    """A ShardClient (polling every 0.05 s) of `shard` served by real gRPC on localhost, in rotation."""
    server = grpc.aio.server()
    shard_pb2_grpc.add_ShardServicer_to_server(shard, server)
    health_pb2_grpc.add_HealthServicer_to_server(shard, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = ShardClient(f"127.0.0.1:{port}", poll_interval_s=0.05)
    client.start()
    try:
        await until_healthy(client)
        yield client
    finally:
        await client.close()
        await server.stop(None)


async def until_healthy(client: ShardClient) -> None:
    for _ in range(100):
        if client.view.healthy:
            return
        await asyncio.sleep(0.05)


def test_a_late_token_of_a_lost_shard_never_reaches_the_sequence(monkeypatch):
    monkeypatch.setattr("router.shard_client.PROBE_TIMEOUT_S", 0.2)

    async def main():
        shard = HungShard()
        async with scripted(shard) as client:
            events = await client.submit(shard_pb2.ShardRequest.Submit(request_id="req-9", prompt_token_ids=[1],
                                                                       max_tokens=8))
            got = [await asyncio.wait_for(events.get(), 10) for _ in range(2)]
            assert [e.token.index for e in got] == [0, 1]
            shard.hang.set()  # its probes stop answering: after PROBES_TO_FAIL misses it leaves rotation
            lost = await asyncio.wait_for(events.get(), 10 + PROBES_TO_FAIL)
            assert isinstance(lost, ShardLost) and lost.kind == "probes_failed" and not client.view.healthy
            shard.release.set()  # the old shard's last token, crossing the failover
            await asyncio.sleep(0.5)
            assert events.empty(), f"after ShardLost the sequence got {events.get_nowait()}"

    asyncio.run(main())


class DrainingShard(HungShard):
    """Sends one token, then hands the sequence over (Moved) and keeps its stream open; its probes go on answering
    SERVING, as a shard's can in the moment between its SIGTERM and the router's next poll."""

    def __init__(self):
        super().__init__()
        self.close_stream = asyncio.Event()

    async def Stream(self, request_iterator, context):
        request = await request_iterator.__anext__()
        rid = request.submit.request_id
        yield shard_pb2.ShardEvent(request_id=rid, token=shard_pb2.ShardEvent.Token(token_id=100, index=0))
        yield shard_pb2.ShardEvent(request_id=rid, moved=shard_pb2.ShardEvent.Moved(computed_tokens=1,
                                                                                   state_bytes=4096))
        await self.close_stream.wait()


def test_a_moved_sequence_takes_its_shard_out_of_rotation_until_its_stream_ends():
    async def main():
        shard = DrainingShard()
        async with scripted(shard) as client:
            events = await client.submit(shard_pb2.ShardRequest.Submit(request_id="req-7", prompt_token_ids=[1],
                                                                       max_tokens=8))
            assert (await asyncio.wait_for(events.get(), 10)).token.index == 0
            moved = await asyncio.wait_for(events.get(), 10)
            assert isinstance(moved, ShardMoved) and (moved.kind, moved.leg_id, moved.computed_tokens,
                                                      moved.state_bytes) == ("drained", "req-7", 1, 4096)
            await asyncio.sleep(0.5)  # ten polls, every one SERVING
            assert not client.view.healthy, "a shard that hands its sequences over must stay out of rotation"
            shard.close_stream.set()  # the drained shard's stream ends (it exits); a SERVING one is a new shard
            await until_healthy(client)
            assert client.view.healthy, "once its stream ended, a SERVING shard is back in rotation"

    asyncio.run(main())
