"""The balancer's view of one shard between two Load answers (router/shard_client.py): sequences sent since the
last answer count against its headroom only while they run."""

import asyncio

from kimiserve.v1 import shard_pb2
from router.balancer import ShardView, pick_shard
from router.shard_client import ShardClient


def _in_rotation(address: str) -> ShardClient:
    client = ShardClient(address)  # not started (no poller, no stream): the view changes only by submit / forget
    client.view.healthy, client.view.free_slots = True, 4
    client._outbox = asyncio.Queue()  # the stream's queue; nothing reads it here
    return client


def test_finished_sequences_stop_counting_against_headroom():
    async def scenario() -> None:
        warm = _in_rotation("127.0.0.1:1")
        for i in range(6):  # six short sequences, one after another, all between two polls
            await warm.submit(shard_pb2.ShardRequest.Submit(request_id=f"r{i}"))
            if i < 5:
                warm.forget(f"r{i}")
        assert (warm.view.sent_since_poll, warm.view.headroom) == (1, 3)
        warm.forget("r5")
        assert (warm.view.in_flight, warm.view.headroom) == (0, 4)
        # the next turn of a conversation stays where its prefix is, not on an equally idle cold shard
        cold = ShardView("cold", healthy=True, free_slots=4)
        assert pick_shard([cold, warm.view], {"127.0.0.1:1": 320}).name == "127.0.0.1:1"
        await warm.close()

    asyncio.run(scenario())


def test_running_sequences_sent_since_the_last_answer_do_count():
    async def scenario() -> None:
        busy = _in_rotation("127.0.0.1:2")
        for i in range(3):
            await busy.submit(shard_pb2.ShardRequest.Submit(request_id=f"r{i}"))
        busy.forget("unknown")  # an id this client never sent changes nothing
        assert busy.view.headroom == 1
        idle = ShardView("idle", healthy=True, free_slots=4)
        assert pick_shard([idle, busy.view], {"127.0.0.1:2": 320}).name == "idle"
        await busy.close()

    asyncio.run(scenario())
