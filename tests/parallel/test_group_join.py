"""Joining a shard group: a rank whose process starts late (importing torch on a loaded host) still joins a group
whose collective timeout is short, and a rank that never arrives fails the group by name once the arrival timeout
has passed."""

from __future__ import annotations

import pytest

from tests.parallel.harness import run_group


def _ranks_seen(group) -> list[object]:
    return group.all_gather_object(group.rank, "gathering ranks")


def test_a_rank_starting_later_than_the_collective_timeout_still_joins():
    ranks = run_group(2, _ranks_seen, collective_timeout_s=1.0, start_delays={1: 4.0}, timeout_s=90.0)
    assert ranks == [[0, 1], [0, 1]]


def test_a_rank_that_never_arrives_fails_the_group_by_name():
    with pytest.raises(AssertionError, match=r"(?s)rank 0:.*GroupError: shard group rank 0 of 2: waiting 2 s for every "
                                             r"rank's process to start failed"):
        run_group(2, _ranks_seen, collective_timeout_s=1.0, start_delays={1: 6.0},
                  join_kwargs={"arrival_timeout_s": 2.0}, timeout_s=90.0)
