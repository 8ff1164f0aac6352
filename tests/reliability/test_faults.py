"""Faults against a supervised stack (`kimiserve up --shards 2`, real processes, real gRPC on localhost).

What each test proves:
- a SIGKILLed shard fails exactly the requests it was running (UNAVAILABLE naming it), the other shard's streams
  finish with exact usage, `up` keeps running, restarts the shard on its port, and the router routes to it again;
- a SIGSTOPped (hung, not dead) shard fails its requests within the router's probe bound, `up` does not restart a
  live process, and after SIGCONT the router takes it back;
- a killed tokenizer fails requests cleanly (UNAVAILABLE, no hang) until `up` has restarted it, then they succeed;
- a router SIGKILLed mid-batch is restarted by `up` on the same port and database and the batch completes with every
  line exactly once (the store-level checks of this are in tests/batch/test_durability.py);
- after each of them every shard's slot and KV-block gauges are back to zero.
`up` itself (signals during startup, a SIGKILLed `up`, giving up on a child) is in test_up.py.
"""

from __future__ import annotations

import os
import signal
import time

import grpc

from kimiserve.v1 import router_pb2
from router.shard_client import PROBE_TIMEOUT_S, PROBES_TO_FAIL
from tests.batch.lines import assert_each_once, slow_lines
from tests.reliability.conftest import stream_many
from tests.services.helpers import generate, scrape, shard_load, total, wait_until

STREAMS = 32  # two shards of 16 state slots (the shard default): every stream runs at once
MAX_TOKENS = 200  # long enough that every stream is mid-generation when the fault comes
FAILED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def finished_on(shard) -> float:
    return total(scrape(shard.metrics_url), "kimiserve_shard_sequences_finished_total")


def faulted_streams(stack, victim_name: str, sig: signal.Signals, join_s: float = 150):
    """32 streams; once all of them sit on the shards (running or queued there), `sig` goes to the victim shard.
    Returns (victim, the number of sequences it held at that moment, outcomes)."""
    threads, outcomes, fault_at = stream_many(stack.stub, STREAMS, MAX_TOKENS)
    victim = stack.child(victim_name)
    placed: dict[str, int] = {}

    def all_placed() -> bool:
        for s in stack.shards():
            load = shard_load(s.address)
            placed[s.name] = load.running_seqs + load.queued_seqs
        return sum(placed.values()) == STREAMS

    wait_until(all_placed, 60, f"{STREAMS} streams on the shards (last seen: {placed}, outcomes {outcomes})")
    held = placed[victim_name]
    assert held > 0, "the test needs streams on the shard it faults"
    fault_at.append(time.monotonic())
    os.kill(victim.pid, sig)
    for t in threads:
        t.join(join_s)
    assert len(outcomes) == STREAMS, f"{STREAMS - len(outcomes)} streams neither finished nor failed"
    return victim, held, outcomes


def assert_only_victim_failed(outcomes, victim, held: int) -> None:
    failed = [o for o in outcomes.values() if o.code is not None]
    done = [o for o in outcomes.values() if o.code is None]
    assert len(failed) == held, f"{len(failed)} streams failed, the victim held {held}: {failed}"
    assert all(o.code in FAILED for o in failed), [(o.code, o.details) for o in failed]
    assert all(victim.address in o.details for o in failed if o.code == grpc.StatusCode.UNAVAILABLE), failed
    assert all(o.streamed == o.completion_tokens == MAX_TOKENS for o in done), \
        [o for o in done if not o.streamed == o.completion_tokens == MAX_TOKENS]


def assert_capacity_back(stack, shard) -> None:
    """A burst the size of both shards' slots all succeeds, and `shard` takes a fair share of it."""
    before = finished_on(shard)
    threads, outcomes, _ = stream_many(stack.stub, STREAMS, 8)
    for t in threads:
        t.join(120)
    assert all(o.code is None and o.streamed == o.completion_tokens == 8 for o in outcomes.values()), outcomes
    assert len(outcomes) == STREAMS
    assert finished_on(shard) - before >= STREAMS // 4, f"{shard.name} served too little of the burst"


def test_shard_sigkill_fails_only_its_requests_and_up_restarts_it(up_stack):
    stack = up_stack
    in_rotation = stack.rotation_events(stack.child("shard-1").address, "shard in rotation")
    victim, held, outcomes = faulted_streams(stack, "shard-1", signal.SIGKILL)
    assert_only_victim_failed(outcomes, victim, held)
    assert all(o.failed_after_s < 10 for o in outcomes.values() if o.code), "a dead shard's stream breaks at once"
    assert stack.proc.poll() is None, "`up` must keep serving when one shard dies"

    restarted = stack.wait_restarted("shard-1", victim.pid)
    assert restarted.address == victim.address, "restarted on the same port"
    exits = [e for e in stack.events("child exited; restarting") if e["pid"] == victim.pid]
    assert [(e["child"], e["signal"], e["attempt"]) for e in exits] == [("shard-1", "SIGKILL", 1)]
    stack.wait_back_in_rotation(restarted.address, in_rotation)
    assert_capacity_back(stack, restarted)
    stack.assert_shards_idle()


def test_shard_sigstop_fails_its_requests_in_bounded_time_and_sigcont_brings_it_back(up_stack):
    stack = up_stack
    bound = PROBES_TO_FAIL * (PROBE_TIMEOUT_S + 1.0) + 10  # the router's probes, plus a loaded box's slack
    address = stack.child("shard-0").address
    in_rotation, left = (stack.rotation_events(address, m) for m in ("shard in rotation", "shard left rotation"))
    try:
        victim, held, outcomes = faulted_streams(stack, "shard-0", signal.SIGSTOP)
        assert_only_victim_failed(outcomes, victim, held)
        late = [o.failed_after_s for o in outcomes.values() if o.code and o.failed_after_s > bound]
        assert not late, f"a hung shard's requests must fail within {bound:.0f} s, took {late}"
        assert stack.child("shard-0").pid == victim.pid, "`up` must not restart a live (stopped) process"
        assert stack.rotation_events(address, "shard left rotation") == left + 1
    finally:
        os.kill(stack.child("shard-0").pid, signal.SIGCONT)
    stack.wait_back_in_rotation(address, in_rotation)
    assert_capacity_back(stack, stack.child("shard-0"))
    stack.assert_shards_idle()


def test_tokenizer_killed_requests_fail_cleanly_then_succeed_after_restart(up_stack):
    stack = up_stack
    tokenizer = stack.child("tokenizer")
    in_flight, outcomes, _ = stream_many(stack.stub, 8, MAX_TOKENS)  # detokenized as they stream
    wait_until(lambda: shard_load(stack.child("shard-0").address).running_seqs
               + shard_load(stack.child("shard-1").address).running_seqs == 8, 60, "8 running streams")
    os.kill(tokenizer.pid, signal.SIGKILL)
    during = []  # (status code, seconds the failed call took) while the tokenizer is down
    while True:
        started = time.monotonic()
        try:
            _, text, last = generate(stack.stub, text="Hello there", max_tokens=4, timeout=30, ignore_eos=True)
            break
        except grpc.RpcError as e:
            during.append((e.code(), e.details(), time.monotonic() - started))
            assert time.monotonic() - started < 30
            assert stack.proc.poll() is None, stack.tail()
            time.sleep(0.05)
    assert last.usage.completion_tokens == 4
    assert during, "no request saw the outage"
    assert all(code == grpc.StatusCode.UNAVAILABLE and "tokenizer" in details and took < 10
               for code, details, took in during), during
    for t in in_flight:
        t.join(120)
    assert len(outcomes) == 8
    assert all(o.code is None and o.streamed == o.completion_tokens == MAX_TOKENS or
               o.code == grpc.StatusCode.UNAVAILABLE for o in outcomes.values()), outcomes
    assert stack.child("tokenizer").pid != tokenizer.pid
    stack.assert_shards_idle()


def test_router_killed_mid_batch_is_restarted_and_every_line_runs_once(up_stack):
    stack = up_stack
    n = 60
    ids = [f"s-{i}" for i in range(n)]
    batch = stack.stub.CreateBatch(router_pb2.CreateBatchRequest(jsonl=slow_lines(n, max_tokens=24),
                                                                 max_concurrency=8), timeout=30)

    def get():
        return stack.stub.GetBatch(router_pb2.GetBatchRequest(batch_id=batch.id), timeout=10)

    wait_until(lambda: get().request_counts.completed >= 10, 120, "10 completed batch requests")
    router = stack.child("router")
    os.kill(router.pid, signal.SIGKILL)
    stack.wait_restarted("router", router.pid)

    wait_until(lambda: get().status == router_pb2.BATCH_STATUS_COMPLETED, 120, "the batch to complete")
    done = get()
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (n, n, 0)
    results = list(stack.stub.GetBatchResults(router_pb2.GetBatchResultsRequest(batch_id=batch.id), timeout=60))
    assert_each_once(results, ids)
    assert all(len(r.response.token_ids) == r.response.usage.completion_tokens == 24 for r in results)
    stack.assert_shards_idle()
