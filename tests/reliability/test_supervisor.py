"""The restart policy of `kimiserve up` (launcher/supervisor.py) on a fake clock: backoff doubling to its cap, giving
up after consecutive quick failures, forgiving a child that stayed up. The real processes are in test_up.py."""

from __future__ import annotations

import pytest

from launcher.supervisor import GaveUp, RestartPolicy, Supervisor


class FakeChild:
    def __init__(self, name: str):
        self.name, self.address = name, f"{name}:1"
        self.health_address = self.address
        self.returncode: int | None = None
        self.pid, self.starts = 100, 0

    def poll(self) -> int | None:
        return self.returncode

    def restart(self) -> None:
        self.returncode, self.pid, self.starts = None, self.pid + 1, self.starts + 1


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_to_its_cap_and_restarts_only_the_dead_child():
    clock, shard, other = Clock(), FakeChild("shard-0"), FakeChild("shard-1")
    sup = Supervisor([shard, other], RestartPolicy(backoff_s=0.5, max_backoff_s=3.0, max_failures=10),
                     clock=clock, serving=lambda _: True)
    delays = []
    for _ in range(5):
        shard.returncode = -9
        sup.check()  # sees the exit, schedules the restart
        died_at = clock.now
        while shard.poll() is not None:
            clock.now += 0.25
            sup.check()
        delays.append(clock.now - died_at)
        clock.now += 1.0  # a quick failure: far less than stable_s after its start
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert shard.starts == 5 and other.starts == 0 and sup.restarts == 5


def test_gives_up_after_max_quick_failures_in_a_row():
    clock, child = Clock(), FakeChild("tokenizer")
    sup = Supervisor([child], RestartPolicy(max_failures=3), clock=clock, serving=lambda _: True)
    for attempt in (1, 2):
        child.returncode = 1
        sup.check()
        clock.now += 60
        sup.check()
        assert child.starts == attempt
    child.returncode = 1
    with pytest.raises(GaveUp, match=r"tokenizer exited 3 times in a row.*'exit_code': 1"):
        sup.check()


def test_a_child_that_stayed_up_is_forgiven_its_earlier_failures():
    clock, child = Clock(), FakeChild("router")
    policy = RestartPolicy(backoff_s=0.5, stable_s=60.0, max_failures=3)
    sup = Supervisor([child], policy, clock=clock, serving=lambda _: True)
    for _ in range(2):  # two quick failures
        child.returncode = -15
        sup.check()
        clock.now += 5
        sup.check()
    clock.now += 61  # then up for a minute
    sup.check()
    child.returncode = -9
    sup.check()  # a third failure, but not in a row with the first two: restarted after the first delay
    clock.now += 0.5
    sup.check()
    assert child.starts == 3 and child.poll() is None


def test_a_clean_exit_is_restarted_at_once_and_is_no_failure():
    """A shard drained by SIGTERM (a rolling restart) exits 0: started again on the next check, with no backoff, and
    however often it happens `up` never gives up on it; a crash right after still gets the first backoff."""
    clock, child = Clock(), FakeChild("shard-0")
    sup = Supervisor([child], RestartPolicy(backoff_s=0.5, max_failures=2), clock=clock, serving=lambda _: True)
    for attempt in range(1, 6):
        child.returncode = 0
        sup.check()  # sees the clean exit
        sup.check()  # and restarts it, no time having passed
        assert child.starts == attempt and child.poll() is None
    child.returncode = -9
    sup.check()
    sup.check()
    assert child.starts == 5, "a crash waits for its backoff"
    clock.now += 0.5
    sup.check()
    assert child.starts == 6
