"""The runner and job state machine with a fake executor (no network): retries of unavailable shards, per-request
failures, a broken store still ending terminal, lease takeover and a cancel made through another router."""

from __future__ import annotations

import asyncio
import json

from prometheus_client import CollectorRegistry

from kimiserve.tenants import DEFAULT, Tenant
from kimiserve.v1 import common_pb2, router_pb2
from router.batch import states
from router.batch.config import BatchConfig
from router.batch.metrics import BatchMetrics
from router.batch.runner import BatchRunner
from router.batch.store import BatchStore
from router.errors import InvalidArgument, ShardUnavailable


ACME = Tenant("acme")


class FakeExecutor:
    """Looks at the prompt: 'flaky-N' fails N times with UNAVAILABLE, 'down' always, 'bad' is INVALID_ARGUMENT,
    'bug' raises a plain exception, 'slow' sleeps; anything else answers at once."""

    def __init__(self):
        self.calls: list[str] = []
        self.tenants: set[Tenant] = set()  # those the requests ran as
        self.failures: dict[str, int] = {}

    async def run(self, kind, payload, request_id, tenant):
        self.calls.append(request_id)
        self.tenants.add(tenant)
        prompt = router_pb2.GenerateRequest.FromString(payload).text
        if prompt.startswith("flaky-"):
            seen = self.failures.get(prompt, 0)
            if seen < int(prompt.split("-")[1]):
                self.failures[prompt] = seen + 1
                raise ShardUnavailable(f"shard gone while serving {request_id!r}")
        if prompt == "down":
            raise ShardUnavailable("no healthy shard")
        if prompt == "bad":
            raise InvalidArgument("temperature must be >= 0, got -1")
        if prompt == "bug":
            raise ValueError("boom")
        if prompt == "slow":
            await asyncio.sleep(30)
        return router_pb2.BatchResponse(text=prompt, token_ids=[1], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                        usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=1))


def jsonl(prompts: dict[str, str]) -> str:
    return "\n".join(json.dumps({"custom_id": c, "url": "/v1/completions", "body": {"prompt": p}})
                     for c, p in prompts.items())


def make_runner(db, owner="r1", executor=None, **cfg) -> BatchRunner:
    cfg = BatchConfig(db_path=db, owner=owner, tick_s=0.02, retry_backoff_s=0.001, **cfg)
    return BatchRunner(BatchStore(db), executor or FakeExecutor(), BatchMetrics(CollectorRegistry()), cfg)


async def wait_terminal(runner: BatchRunner, batch_id: str, timeout=10.0):
    for _ in range(int(timeout / 0.01)):
        row = runner.store.get(batch_id)
        if row.terminal:
            return row
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch {batch_id} still {runner.store.get(batch_id).status}")


def results(runner, batch_id) -> dict[str, router_pb2.BatchResult]:
    out = [router_pb2.BatchResult.FromString(b) for b in runner.store.results(batch_id, 0, 1000)]
    assert len(out) == len({r.custom_id for r in out})
    return {r.custom_id: r for r in out}


def test_retries_and_per_request_failures(tmp_path):
    async def main():
        runner = make_runner(tmp_path / "b.db", max_attempts=3)
        runner.start()
        row = runner.create(router_pb2.CreateBatchRequest(jsonl=jsonl(
            {"ok": "hello", "flaky": "flaky-2", "down": "down", "bad": "bad", "bug": "bug"})), ACME)
        done = await wait_terminal(runner, row.id)
        await runner.stop(1)
        return runner, done

    runner, done = asyncio.run(main())
    assert (done.status, done.completed, done.failed) == (states.COMPLETED, 2, 3)
    res = results(runner, done.id)
    assert res["flaky"].response.text == "flaky-2" and res["flaky"].request_id == f"{done.id}:flaky:3"
    assert (res["down"].error.code, res["down"].request_id) == ("unavailable", f"{done.id}:down:3")
    assert res["bad"].error.code == "invalid_argument" and "temperature" in res["bad"].error.message
    assert res["bug"].error.code == "internal" and "ValueError: boom" in res["bug"].error.message
    assert sorted(c for c in runner.executor.calls if ":bug:" in c) == [f"{done.id}:bug:1"]  # a bug is not retried
    assert done.tenant == "acme" and runner.executor.tenants == {ACME}  # its requests ran as its creator


def test_a_store_failure_still_ends_terminal_with_one_result_each(tmp_path, monkeypatch):
    async def main():
        runner = make_runner(tmp_path / "b.db")
        real_record = runner.store.record
        calls = []

        def flaky_record(batch_id, new):
            calls.append(1)
            if len(calls) == 2:
                raise OSError("disk full")
            return real_record(batch_id, new)

        monkeypatch.setattr(runner.store, "record", flaky_record)
        runner.start()
        row = runner.create(router_pb2.CreateBatchRequest(jsonl=jsonl({f"r{i}": "hi" for i in range(6)}),
                                                          max_concurrency=1), DEFAULT)
        done = await wait_terminal(runner, row.id)
        await runner.stop(1)
        return runner, done

    runner, done = asyncio.run(main())
    assert done.status == states.FAILED and done.errors[0]["code"] == "internal"
    assert "disk full" in done.errors[0]["message"]
    res = results(runner, done.id)
    assert sorted(res) == [f"r{i}" for i in range(6)]
    assert sum(r.HasField("response") for r in res.values()) == done.completed >= 1
    assert {r.error.code for r in res.values() if r.HasField("error")} == {"internal"}


def test_lease_takeover_and_cancel_through_another_router(tmp_path):
    async def main():
        db = tmp_path / "shared.db"
        dead = make_runner(db, owner="dead", lease_s=0.2)  # creates a batch, never runs (as if killed)
        orphan = dead.create(router_pb2.CreateBatchRequest(jsonl=jsonl({"a": "x", "b": "y"})), DEFAULT)
        alive = make_runner(db, owner="alive", lease_s=5)
        alive.start()
        assert not alive.store.get(orphan.id).terminal
        taken = await wait_terminal(alive, orphan.id)  # after the dead router's lease ran out

        slow = alive.create(router_pb2.CreateBatchRequest(jsonl=jsonl({"s1": "slow", "s2": "slow", "s3": "x"}),
                                                          max_concurrency=2), DEFAULT)
        for _ in range(500):
            if len(alive.executor.calls) >= 4:  # a, b, then both slow requests running
                break
            await asyncio.sleep(0.01)
        other = make_runner(db, owner="other")  # another router sharing the store, not running this batch
        assert other.cancel(slow.id, DEFAULT).status == states.CANCELLING
        cancelled = await wait_terminal(alive, slow.id)
        await alive.stop(1)
        return alive, taken, cancelled

    alive, taken, cancelled = asyncio.run(main())
    assert (taken.status, taken.owner, taken.completed) == (states.COMPLETED, "alive", 2)
    assert cancelled.status == states.CANCELLED and cancelled.failed == 3
    assert {r.error.code for r in results(alive, cancelled.id).values()} == {"batch_cancelled"}
