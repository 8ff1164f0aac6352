"""Joining a shard group: a rank whose process starts late (importing torch on a loaded host) still joins a group
whose collective timeout is short; a rank that never arrives fails the group by name once the arrival timeout has
passed, and one the leader's watchdog knows dead fails it at once."""

from __future__ import annotations

import time

import pytest

from tests.parallel.harness import run_group


def _ranks_seen(group) -> list[object]:
    return group.all_gather_object(group.rank, "gathering ranks")


def _rank_1_was_killed() -> str:
    return "; rank 1 (pid 4242) was killed by SIGKILL"


def test_a_rank_starting_later_than_the_collective_timeout_still_joins():
    ranks = run_group(2, _ranks_seen, collective_timeout_s=1.0, start_delays={1: 3.0}, timeout_s=90.0)
    assert ranks == [[0, 1], [0, 1]]


def test_a_rank_that_never_arrives_fails_the_group_by_name():
    with pytest.raises(AssertionError, match=r"(?s)rank 0:.*GroupError: shard group rank 0 of 2: waiting for every "
                                             r"rank's process to start failed: rank\(s\) \[1\] had not arrived after "
                                             r"\d+\.\d s \(limit 1 s\)"):
        run_group(2, _ranks_seen, collective_timeout_s=0.5, absent=frozenset({1}),
                  join_kwargs={"arrival_timeout_s": 1.0}, timeout_s=90.0)


def test_a_rank_known_dead_fails_the_wait_at_once_by_name():
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 0:.*GroupError: shard group rank 0 of 2: waiting for every "
                                             r"rank's process to start failed; rank 1 \(pid 4242\) was killed by "
                                             r"SIGKILL: rank\(s\) \[1\] had not arrived"):
        run_group(2, _ranks_seen, collective_timeout_s=1.0, absent=frozenset({1}),
                  join_kwargs={"failure_hint": _rank_1_was_killed}, timeout_s=90.0)
    assert time.monotonic() - started < 30  # not the 120 s arrival timeout
