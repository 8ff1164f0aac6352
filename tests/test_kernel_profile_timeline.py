"""bench/kernel_profile.py's timeline: busy time is the union of kernel intervals (overlaps count once), idle time
is what lies between them, and gaps over 5 us are counted apart (launch gaps)."""

from bench.kernel_profile import timeline


def test_busy_is_the_union_and_idle_the_gaps_between():
    # [0, 10] and [4, 12] overlap (busy 12), then a 2 us gap, [14, 20], a 30 us gap, [50, 51] inside nothing else,
    # and [15, 18] inside [14, 20]
    t = timeline([(14.0, 20.0), (0.0, 10.0), (50.0, 51.0), (4.0, 12.0), (15.0, 18.0)])
    assert t == {"span_us": 51.0, "busy_us": 12.0 + 6.0 + 1.0, "idle_us": 2.0 + 30.0, "idle_in_gaps_over_5us": 30.0}


def test_one_kernel_is_all_busy():
    assert timeline([(3.0, 7.5)]) == {"span_us": 4.5, "busy_us": 4.5, "idle_us": 0.0, "idle_in_gaps_over_5us": 0.0}
