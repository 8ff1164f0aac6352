"""kimiserve.ports.use_range: this process's free ports come from its slice, in turn, skipping taken ones."""

from __future__ import annotations

import socket

import pytest

from kimiserve import ports


@pytest.fixture
def slice_of_ten(monkeypatch):
    """Ten ports of this worker's slice, as its own range for the test (the worker's range and cursor come back)."""
    lo = ports.free_port()
    monkeypatch.setattr(ports._Range, "span", ports._Range.span)
    monkeypatch.setattr(ports._Range, "cursor", ports._Range.cursor)
    ports.use_range(lo, lo + 10)
    return lo


def test_the_suite_hands_out_ports_below_the_ephemeral_range():
    assert ports._Range.span is not None and ports._Range.span[1] <= 32768
    assert all(ports._Range.span[0] <= p < ports._Range.span[1] for p in ports.free_ports(3))


def test_ports_come_in_turn_distinct_and_skip_a_taken_one(slice_of_ten):
    lo = slice_of_ten
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", lo + 1))
        taken.listen()
        assert ports.free_ports(3) == [lo, lo + 2, lo + 3]
        assert ports.free_port() == lo + 4  # the next call goes on from there


def test_a_range_with_nothing_free_is_refused_naming_it(slice_of_ten):
    lo = slice_of_ten
    held = [socket.socket() for _ in range(10)]
    try:
        for i, s in enumerate(held):
            s.bind(("127.0.0.1", lo + i))
        with pytest.raises(ports.PortInUse, match=f"no free port on 127.0.0.1 in {lo}-{lo + 9}"):
            ports.free_port()
    finally:
        for s in held:
            s.close()
