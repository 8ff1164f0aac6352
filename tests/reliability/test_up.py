"""`kimiserve up` itself, as real processes: a signal during startup leaves no child behind, a clean stop drains in
order and exits 0, a SIGKILLed `up` takes its children with it, and a child that cannot be kept running stops the
stack with a non-zero exit, and a lone shard's drain finishes its streams itself. (One dead shard while the rest
serves is in test_faults.py.)"""

from __future__ import annotations

import shutil
import signal
import time
from datetime import datetime

import pytest

from tests.reliability.conftest import alive, stream_many
from tests.services.helpers import shard_load, wait_until


def wait_gone(pids: set[int], timeout: float, what: str) -> None:
    wait_until(lambda: not alive(pids), timeout, f"{what}: pids {sorted(alive(pids))} still running")


def when(entry: dict) -> datetime:
    return datetime.fromisoformat(entry["ts"])


@pytest.mark.parametrize("phase", ["shard-1", "router"])
def test_sigterm_during_startup_stops_every_child_started(make_up, phase):
    stack = make_up()
    wait_until(lambda: phase in stack.children(), 60, f"`up` to start {phase}")
    stack.proc.send_signal(signal.SIGTERM)  # the stack is not SERVING yet: `up` is still waiting on it
    assert stack.stop(60) == 0, stack.tail()
    started = stack.all_pids()
    assert len(started) == {"shard-1": 3, "router": 4}[phase]
    wait_gone(started, 10, "children of an `up` stopped during startup")
    assert stack.events("stopped during startup")


def test_clean_stop_drains_router_first_with_up_drain_timeout_and_exits_0(make_up):
    stack = make_up("--drain-timeout", "7").wait_up()
    pids = stack.all_pids()
    assert stack.stop(60) == 0, stack.tail()
    assert not alive(pids)
    router_drain = stack.events("router draining", service="router")
    assert [e["timeout_s"] for e in router_drain] == [7.0], "up passes its --drain-timeout to the router"
    shard_drain = stack.events("shard draining", service="shard")
    tokenizer_stop = stack.events("tokenizer service stopped", service="tokenizer")
    assert len(shard_drain) == 2 and len(tokenizer_stop) == 1
    assert when(router_drain[0]) <= min(map(when, shard_drain)) <= max(map(when, shard_drain)) \
        <= when(tokenizer_stop[0])
    assert stack.events("stack stopped")[0]["restarts"] == 0


def test_sigkilled_up_takes_its_children_with_it(make_up):
    stack = make_up().wait_up()
    pids = stack.all_pids()
    assert len(pids) == 4
    stack.proc.send_signal(signal.SIGKILL)
    stack.proc.wait(10)
    wait_gone(pids, 30, "children of a SIGKILLed `up` (PR_SET_PDEATHSIG)")


def test_a_child_failing_at_every_restart_stops_the_stack_with_exit_1(make_up, tiny_linear, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_linear, model)
    stack = make_up("--max-restarts", "3", model=model).wait_up()
    shutil.rmtree(model)  # every restart of the tokenizer now fails at once: nothing to load
    tokenizer = stack.signal("tokenizer", signal.SIGKILL)
    started = time.monotonic()
    assert stack.proc.wait(90) == 1, stack.tail()
    assert time.monotonic() - started < 60
    wait_gone(stack.all_pids(), 10, "children after `up` gave up")
    exits = [e for e in stack.events("child exited; restarting") if e["child"] == "tokenizer"]
    assert exits[0]["pid"] == tokenizer.pid and exits[0]["signal"] == "SIGKILL"
    assert [e["attempt"] for e in exits] == [1, 2] and all(e["exit_code"] != 0 for e in exits[1:])
    gave_up = stack.events("child keeps failing; giving up")
    assert [(e["child"], e["failures"]) for e in gave_up] == [("tokenizer", 3)]


def test_a_lone_shards_sigterm_finishes_its_streams_itself_and_up_restarts_it(make_up):
    """With no other shard to take them, the router sends sequences unmovable: a drain generates them to the end
    instead of handing them over (docs/failover.md)."""
    stack = make_up(shards=1).wait_up()
    threads, outcomes, _ = stream_many(stack.stub, 4, 400)  # long enough to outlast the polling
    shard = stack.child("shard-0")
    # every stream running or already done (on a loaded machine the first can finish before the last starts), and
    # one at least still running for the drain to finish
    wait_until(lambda: 0 < (running := shard_load(shard.address, stack.internal_token).running_seqs)
               and running + len(outcomes) == 4, 60, "4 streams running or done, one at least running")
    signalled = time.monotonic()
    stack.signal("shard-0", signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert [(o.code, o.completion_tokens) for o in sorted(outcomes.values(), key=lambda o: o.index)] == \
        [(None, 400)] * 4, outcomes
    assert max(o.ended_at for o in outcomes.values()) > signalled, "no stream was left for the drain to finish"
    assert not stack.events("sequence handed over", service="shard")
    stack.wait_restarted("shard-0", shard.pid)
