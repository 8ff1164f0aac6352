"""Priority admission (no network): interactive waiters are served before batch waiters, batch requests only use
the shard capacity left free, and only interactive requests are refused when the queue is full."""

import asyncio

import pytest

from router.admission import BATCH, PRIORITY, Admission
from router.errors import Overloaded
from router.metrics import RouterMetrics


async def hold(adm, name, priority, order, release: asyncio.Event):
    PRIORITY.set(priority)
    async with adm.slot(name):
        order.append(name)
        await release.wait()


def test_interactive_waiters_go_first():
    async def main():
        adm = Admission(max_in_flight=1, max_queued=10, metrics=RouterMetrics())
        order, gates = [], {n: asyncio.Event() for n in ("b0", "b1", "b2", "i0", "i1")}
        tasks = [asyncio.create_task(hold(adm, "b0", BATCH, order, gates["b0"]))]
        await asyncio.sleep(0)
        for name, prio in (("b1", BATCH), ("b2", BATCH), ("i0", "interactive"), ("i1", "interactive")):
            tasks.append(asyncio.create_task(hold(adm, name, prio, order, gates[name])))
            await asyncio.sleep(0)
        for name in ("b0", "i0", "i1", "b1", "b2"):
            gates[name].set()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == ["b0", "i0", "i1", "b1", "b2"]


def test_batch_uses_only_free_shard_capacity_and_is_never_refused():
    async def main():
        capacity = [2]
        metrics = RouterMetrics()
        adm = Admission(max_in_flight=10, max_queued=0, metrics=metrics)
        adm.batch_capacity = lambda: capacity[0]
        order, release = [], asyncio.Event()
        tasks = [asyncio.create_task(hold(adm, f"b{i}", BATCH, order, release)) for i in range(4)]
        await asyncio.sleep(0.01)
        assert order == ["b0", "b1"]  # capacity 2, so b2 and b3 wait (and are not refused despite max_queued=0)
        assert adm.waiting(BATCH) == 2
        assert metrics.registry.get_sample_value("kimiserve_router_queued_requests") == 0  # interactive only
        tasks.append(asyncio.create_task(hold(adm, "i0", "interactive", order, release)))
        await asyncio.sleep(0.01)
        assert order == ["b0", "b1", "i0"]  # interactive is not limited by the batch capacity
        capacity[0] = 4
        adm.kick()
        await asyncio.sleep(0.01)
        assert order == ["b0", "b1", "i0", "b2"]  # 4 in flight = capacity
        release.set()
        await asyncio.gather(*tasks)
        assert adm._in_flight == 0

    asyncio.run(main())


def test_interactive_refused_when_queue_full_and_cancelled_waiters_leave():
    async def main():
        adm = Admission(max_in_flight=1, max_queued=1, metrics=RouterMetrics())
        order, release = [], asyncio.Event()
        first = asyncio.create_task(hold(adm, "i0", "interactive", order, release))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(hold(adm, "i1", "interactive", order, release))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="'i2' refused"):
            async with adm.slot("i2"):
                pass
        waiter.cancel()
        await asyncio.sleep(0)
        release.set()
        await first
        assert order == ["i0"] and adm._in_flight == 0 and not adm._waiters["interactive"]

    asyncio.run(main())
