"""kimiserve/seeds.py: the position keys are a splitmix64 stream, checked against the algorithm's published output,
and draw_seed gives uint64 seeds."""

from __future__ import annotations

import pytest

from kimiserve.seeds import draw_seed, mix64, position_seed

GOLDEN = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


class SplitMix64:
    """The reference generator written out as the C original steps it: add the increment, then scramble."""

    def __init__(self, state: int) -> None:
        self.state = state

    def next(self) -> int:
        self.state = (self.state + GOLDEN) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)


def test_the_reference_generator_gives_the_published_outputs():
    # Rosetta Code, "Pseudo-random numbers/Splitmix64": the first five outputs for the seed 1234567.
    rng = SplitMix64(1234567)
    assert [rng.next() for _ in range(5)] == [6457827717110365317, 3203168211198807973, 9817491932198370423,
                                              4593380528125082431, 16408922859458223821]


@pytest.mark.parametrize("seed", [0, 1, 1234567, 1 << 63, MASK])
def test_position_keys_are_the_splitmix64_stream_of_the_mixed_seed(seed):
    rng = SplitMix64(mix64(seed))
    assert [position_seed(seed, p) for p in range(50)] == [rng.next() for _ in range(50)]


def test_nearby_seeds_and_positions_give_distinct_keys():
    """Choice i of a request samples with seed + i: its keys must not be another choice's keys at shifted
    positions."""
    keys = [position_seed(s, p) for s in range(16) for p in range(4096)]
    assert len(set(keys)) == len(keys)


def test_out_of_range_inputs_are_refused():
    with pytest.raises(ValueError, match="seed -1 outside the uint64 range"):
        position_seed(-1, 0)
    with pytest.raises(ValueError, match=f"seed {1 << 64} outside the uint64 range"):
        position_seed(1 << 64, 0)
    with pytest.raises(ValueError, match="position -3 is negative"):
        position_seed(5, -3)


def test_drawn_seeds_are_uint64_and_fresh():
    seeds = [draw_seed() for _ in range(64)]
    assert all(0 <= s <= MASK for s in seeds)
    assert len(set(seeds)) == 64
    assert max(seeds) >= 1 << 62, "64 uniform draws all below 2^62 (chance 2^-128): not using the high bits"
