"""Prefix-cache snapshot points inside a prefill pass, through the whole model on each op backend (Triton under the
interpreter on the CPU): the entry written mid-pass holds the KDA recurrent and conv states and the logits row that a
pass ending at the point leaves, and the pass's own results do not change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import EAGER, select_ops
from tests.engine.conftest import linear_config, random_model
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close

# Interval points every 40 tokens: 40, 80 and 120 inside the first pass of 128. The engine puts message points on
# the KDA chunk grid (engine/prefix_cache.py), an operator's interval need not be: 120 is off every chunk size's grid
# (7 x 16 + 8, 64 + 56), so the kernels cut a chunk there.
INTERVAL, POINT, LENGTH = 40, 120, 150
# The two passes have different shapes (the logits rows: 1 or 4 in one product), which BLAS rounds differently.
TOL = 3e-3 if ON_GPU else 3e-5


def _engine(backend: str, entries: int, interval: int = 0) -> Engine:
    cfg, model = random_model(linear_config(), seed=0, dtype=torch.float32)
    ops = select_ops(DEVICE, backend)
    if not ON_GPU:  # the experts hold no state: their kernels would only add interpreter time here (6 s)
        ops = dataclasses.replace(ops, moe_experts=EAGER["moe_experts"], moe_experts_shared=None)
    return Engine(cfg, model.to(DEVICE), ops, DEVICE,
                  EngineConfig(num_state_slots=4, num_kv_blocks=64, kv_block_size=8, prefill_token_budget=128,
                               prefix_cache_entries=entries, prefix_state_interval=interval))


def _prefill(engine: Engine, rid: str, prompt: list[int]) -> list[int]:
    seq = engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while not seq.finished:
        engine.step()
    return seq.output


def _entry_state(engine: Engine, tokens: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    entry = engine.prefix_cache.lookup(tokens)
    assert entry is not None and entry.length == len(tokens)
    pool = engine.runner.kda_pool
    return [pool.recurrent[:, entry.slot].clone(), pool.conv[:, entry.slot].clone()], entry.logits


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_a_point_inside_a_pass_is_the_state_a_pass_ending_there_leaves(backend):
    prompt = torch.randint(1, 250, (LENGTH,), generator=torch.Generator().manual_seed(3)).tolist()
    inside = _engine(backend, entries=6, interval=INTERVAL)
    out = _prefill(inside, "whole", prompt)
    assert inside.prefix_cache.stats.snapshots_interval == 3
    ended = _engine(backend, entries=4)
    _prefill(ended, "start", prompt[:POINT])  # a pass ending at the point: its prompt-end entry
    got_states, got_logits = _entry_state(inside, prompt[:POINT])
    want_states, want_logits = _entry_state(ended, prompt[:POINT])
    for name, got, want in zip(("recurrent", "conv"), got_states, want_states, strict=True):
        assert_close(f"{name} state at the point", got, want, TOL)
    assert_close("logits before the point", got_logits, want_logits, TOL)
    plain = _engine(backend, entries=0)
    assert _prefill(plain, "whole", prompt) == out  # the pass's own tokens are unchanged by the point


@pytest.mark.parametrize("m", [1, 2, 3, 4, 11])
def test_the_conv_window_at_a_point_is_short_convs_state_after_those_tokens(m):
    """Points before, at and past the window's width (W-1 = 3): the window mixes the state before the pass with the
    pass's first inputs until it holds only the latter."""
    from shard_svc.ops.conv import short_conv, snapshot_conv_states

    g = torch.Generator().manual_seed(m)
    x, weight = torch.randn(20, 6, generator=g), torch.randn(6, 4, generator=g)
    pool = torch.randn(4, 6, 3, generator=g)
    want = pool.clone()
    short_conv(x[2:2 + m], weight, want, torch.tensor([1]), torch.tensor([0, m]))  # a pass ending at the point
    got = pool.clone()
    snapshot_conv_states(x, got, [(1, 2, m, 3)])  # sequence in slot 1 starting at row 2, point after m, into slot 3
    assert torch.equal(got[3], want[1]) and torch.equal(got[:3], pool[:3])
