"""bench/split_divergence.py names the first op call where a split prefill's tail leaves the one pass: an op that
rounds by the pass's size (equal inputs, other output) or code outside the seam (inputs already differ)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from bench.split_divergence import Call, divergence, first_divergence
from shard_svc.config import ModelConfig
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.ops import select_ops


def _calls(*specs) -> list[Call]:
    return [Call(op, [torch.tensor([[x]])], [torch.tensor([[y]])]) for op, x, y in specs]


def test_the_first_op_with_equal_inputs_and_another_output_is_named():
    one = _calls(("rms_norm", 1.0, 2.0), ("linear", 2.0, 3.0), ("glu", 3.0, 4.0))
    split = _calls(("rms_norm", 1.0, 2.0), ("linear", 2.0, 3.5), ("glu", 3.5, 4.5))
    got = first_divergence(one, split)
    assert (got["call"], got["op"], got["cause"], got["previous_op"]) == (1, "linear", "op", "rms_norm")
    assert got["max_abs_diff"] == 0.5 and got["differing_outputs_by_op"] == {"linear": 1, "glu": 1}


def test_inputs_that_differ_first_put_the_cause_before_the_op():
    got = first_divergence(_calls(("linear", 1.0, 2.0), ("glu", 5.0, 6.0)),
                           _calls(("linear", 1.0, 2.0), ("glu", 5.25, 6.0)))
    assert (got["call"], got["op"], got["cause"], got["previous_op"]) == (1, "glu", "before", "linear")
    assert first_divergence(_calls(("linear", 1.0, 2.0)), _calls(("linear", 1.0, 2.0)))["cause"] == "none"
    with pytest.raises(ValueError, match="different ops from call 1"):
        first_divergence(_calls(("linear", 1.0, 2.0), ("glu", 1.0, 1.0)), _calls(("linear", 1.0, 2.0)))


def test_a_tiny_models_split_is_traced_call_by_call_and_a_size_dependent_op_is_caught(tiny_linear):
    """On a real model (tiny kimi_linear, float64, eager ops, a split on the KDA chunk grid) the two passes' calls
    pair up, and the first op, made to round by the pass's size, is named at call 0 with equal inputs."""
    cfg = ModelConfig.from_dict(json.loads((tiny_linear / "config.json").read_text()))
    from shard_svc.checkpoint.dummy import dummy_model

    device = torch.device("cpu")
    engine = Engine(cfg, dummy_model(cfg, device, torch.float64), select_ops(device), device,
                    EngineConfig(num_state_slots=4, kv_block_size=16, prefill_token_budget=4096, num_kv_blocks=64))
    plain = divergence(engine, 128, 24)
    assert plain["calls"] > cfg.num_layers and plain["call"] != 0, plain
    ops = engine.runner.ops
    first = _first_op(engine)
    size_dependent = getattr(ops, first)

    def rounds_by_size(*args, **kwargs):
        out = size_dependent(*args, **kwargs)
        tensor = out[0] if isinstance(out, tuple) else out
        tensor.add_(1e-9 * tensor.shape[0])  # what a kernel chosen by M does to the last bits
        return out

    engine.runner.ops = dataclasses.replace(ops, **{first: rounds_by_size})
    caught = divergence(engine, 128, 24)
    assert (caught["call"], caught["op"], caught["cause"]) == (0, first, "op"), caught


def _first_op(engine: Engine) -> str:
    from bench.pass_overhead import continuation, eager
    from bench.split_divergence import recorded

    calls = recorded(engine, 8, 8, eager(engine, continuation(engine, 0, 8, "first-op")))
    engine.cancel("first-op")
    return calls[0].op
