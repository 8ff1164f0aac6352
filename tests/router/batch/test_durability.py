"""The router SIGKILLed mid-batch and restarted on the same database: the batch resumes and completes, every
custom_id has exactly one result, and results recorded before the kill are kept as they were, never re-run."""

from __future__ import annotations

import sqlite3

from kimiserve.v1 import router_pb2
from tests.router.batch.lines import assert_each_once, slow_lines


def stored_results(db, batch_id) -> dict[int, bytes]:
    with sqlite3.connect(db) as con:  # the killed router's WAL is read (and checkpointed) like any other
        return dict(con.execute("SELECT idx, payload FROM results WHERE batch_id = ?", (batch_id,)).fetchall())


def test_sigkill_mid_batch_then_restart_resumes_without_loss_or_duplicates(make_router):
    r = make_router()
    n = 120
    ids = [f"s-{i}" for i in range(n)]
    batch = r.create(slow_lines(n, max_tokens=24), max_concurrency=8)
    r.wait(batch.id, until=lambda b: b.request_counts.completed >= 20)
    r.kill()

    before = stored_results(r.db, batch.id)
    assert 20 <= len(before) < n, "results are committed as they complete, before the batch ends"
    with sqlite3.connect(r.db) as con:
        status, = con.execute("SELECT status FROM batches WHERE id = ?", (batch.id,)).fetchone()
    assert status == "in_progress"
    before_ids = {router_pb2.BatchResult.FromString(p).custom_id for p in before.values()}

    r.start()  # same port (so the same owner name) and the same --batch-db
    done = r.wait(batch.id, timeout=120)
    assert done.status == router_pb2.BATCH_STATUS_COMPLETED, done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (n, n, 0)
    results = r.results(batch.id)
    assert_each_once(results, ids)
    assert all(len(x.response.token_ids) == 24 for x in results)
    after = stored_results(r.db, batch.id)
    assert all(after[idx] == payload for idx, payload in before.items()), "a recorded result changed"

    second_run = r.logs(this_run_only=True)
    restarted = {e["custom_id"] for e in second_run if e.get("msg") == "batch request started"}
    assert restarted, "the restarted router should have run the remaining requests"
    assert not restarted & before_ids, f"completed requests were run again: {sorted(restarted & before_ids)}"
    assert restarted | before_ids == set(ids)
    assert any(e.get("msg") == "batch claimed" and e.get("batch_id") == batch.id for e in second_run)
    # A request that was running at the kill runs again under a new id (attempt 2), so the shards never see a
    # duplicate request id.
    rerun_ids = [e["request_id"] for e in second_run if e.get("msg") == "batch request started"]
    assert any(rid.endswith(":2") for rid in rerun_ids) and len(set(rerun_ids)) == len(rerun_ids)


def test_sigterm_mid_batch_drains_and_a_restart_finishes_it(make_router):
    r = make_router("--drain-timeout", "10")
    n = 60
    batch = r.create(slow_lines(n, max_tokens=24), max_concurrency=4)
    r.wait(batch.id, until=lambda b: b.request_counts.completed >= 4)
    assert r.stop() == 0  # SIGTERM: stops dispatching, lets running requests finish, releases the lease
    with sqlite3.connect(r.db) as con:
        status, lease = con.execute("SELECT status, lease_until_ms FROM batches WHERE id = ?",
                                    (batch.id,)).fetchone()
    assert (status, lease) == ("in_progress", 0)
    stopped = [e for e in r.logs() if e.get("msg") == "batch runner stopped"]
    assert stopped and stopped[-1]["released_batch_ids"] == [batch.id]
    r.start()
    done = r.wait(batch.id)
    assert done.status == router_pb2.BATCH_STATUS_COMPLETED and done.request_counts.completed == n
    assert_each_once(r.results(batch.id), [f"s-{i}" for i in range(n)])
