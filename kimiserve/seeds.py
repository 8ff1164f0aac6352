"""Sampling seeds, one rule for the router and the shard: the seed a sampled sequence draws with, and the key of the
draw at each position of it.

A sampled token's randomness is a function of (seed, position) and nothing else, position being the token's
absolute index in the sequence (prompt length + tokens generated before it). So a continuation -- the prompt plus
the first k tokens of an output, resubmitted with the same seed -- draws at each position exactly what the
original did: that is how a stream fails over from one shard to another token for token. A seed is a uint64 (the
wire's SamplingParams.seed).

The key is the (position + 1)-th output of a splitmix64 stream (Steele, Lea and Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014; the constants are Vigna's reference C) whose state starts at
mix64(seed): every key is a full 64-bit avalanche of both inputs. The seed is mixed before the positions are
added so that nearby seeds (the router gives choice i of a request seed + i) start unrelated streams rather than
copies of one stream shifted along it.
"""

from __future__ import annotations

import secrets

SEED_BITS = 64
_MASK = (1 << SEED_BITS) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd: splitmix64's state increment


def mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of [0, 2^64) whose every output bit depends on every input bit."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The 64-bit key of the draw at `position` (0-based, absolute in the sequence) of a sequence seeded `seed`."""
    if not 0 <= seed <= _MASK:
        raise ValueError(f"seed {seed} outside the uint64 range [0, 2^64)")
    if position < 0:
        raise ValueError(f"position {position} is negative")
    return mix64(mix64(seed) + (position + 1) * _GOLDEN)


def draw_seed() -> int:
    """A fresh uniform uint64 seed for a request that set none. Drawn once per sequence where it starts (the router,
    before it submits), so a continuation of that sequence can be sent with the same seed and continue as the
    original would have."""
    return secrets.randbits(SEED_BITS)
