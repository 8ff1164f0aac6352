"""bench/routing_sensitivity.py's pinned routing replays the choices it recorded (else its README figures would
compare nothing): on the trained Kimi-Linear, a pinned replay of an unperturbed run gives its logits bit for bit, and
a replay of other experts moves them."""

from __future__ import annotations

import torch

from bench.routing_sensitivity import Routing, prompt_logits
from bench.trained_parity import held_out_windows
from tests.trained.conftest import LINEAR, model_dir


def test_pinned_routing_replays_the_recorded_choices():
    path = model_dir(LINEAR)
    windows = [w[:64] for w in held_out_windows(path)[:2]]
    free = Routing()
    ref = prompt_logits(path, windows, free, torch.float32, 0.0)
    assert len(free.recorded) == len(free.margins) == 3  # one call per MoE layer: one pass holds both windows
    pinned = Routing()
    pinned.recorded, pinned.pinned = free.recorded, True
    assert torch.equal(prompt_logits(path, windows, pinned, torch.float32, 0.0), ref)
    assert pinned.calls == 3
    other = Routing()
    other.recorded, other.pinned = [(ids + 1) % 8 for ids in free.recorded], True
    assert not torch.allclose(prompt_logits(path, windows, other, torch.float32, 0.0), ref)
