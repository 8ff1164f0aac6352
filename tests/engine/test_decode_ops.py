"""A runner's decode ops (ModelRunner.decode_ops): batch-invariant mode runs prompt rows on its invariant ops and
decode-only passes on the fast ones, since only prompt rows must round alike in any split. Set apart, each op set
sees only its own passes; the weight streamer's wrapping reaches both; replacing `ops` on a runner without a
decode set of its own replaces what decode runs too."""

from __future__ import annotations

import dataclasses

import torch

from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import Ops, select_ops
from shard_svc.weight_streaming import StreamOptions, WeightStreamer
from shard_svc.weight_streaming.host import HostWeights
from tests.engine.conftest import linear_config, make_engine, random_model

CPU = torch.device("cpu")
PROMPT = list(range(1, 12))
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
CONFIG = EngineConfig(num_state_slots=2, num_kv_blocks=32, kv_block_size=16, prefill_token_budget=64)


def counting(ops: Ops, calls: list[tuple[str, int]], name: str) -> Ops:
    """ops whose linear records (name, rows) per call."""
    def linear(x, weight):
        calls.append((name, x.reshape(-1, x.shape[-1]).shape[0]))
        return ops.linear(x, weight)

    return dataclasses.replace(ops, linear=linear)


def test_decode_only_passes_run_the_decode_ops_and_prompt_rows_the_others():
    cfg, model = random_model(linear_config())
    eager, calls = select_ops(CPU, "eager"), []
    engine = Engine(cfg, model, counting(eager, calls, "prefill"), CPU, CONFIG,
                    decode_ops=counting(eager, calls, "decode"))
    seq = engine.generate(PROMPT, GREEDY)
    assert seq.output == make_engine(linear_config(), **dataclasses.asdict(CONFIG)).generate(PROMPT, GREEDY).output
    prefill = [rows for name, rows in calls if name == "prefill"]
    decode = [rows for name, rows in calls if name == "decode"]
    # one prefill pass gives the first token, three decode passes of one row the rest, each pass the same linears
    assert max(prefill) == len(PROMPT) and set(decode) == {1}
    assert len(decode) == 3 * len(prefill), (len(prefill), len(decode))


def test_the_weight_streamer_wraps_both_op_sets():
    cfg, model = random_model(linear_config())
    eager = select_ops(CPU, "eager")
    engine = Engine(cfg, model, eager, CPU, CONFIG, decode_ops=dataclasses.replace(eager))
    WeightStreamer(cfg, model, HostWeights.from_model(cfg, model), CPU, StreamOptions()).attach(engine.runner)
    for ops in (engine.runner.ops, engine.runner.decode_ops):
        assert dict(ops.backends)["moe_experts"].endswith("+stream"), ops.backends
    assert engine.generate(PROMPT, GREEDY).output == make_engine(linear_config(), **dataclasses.asdict(CONFIG)
                                                                 ).generate(PROMPT, GREEDY).output


def test_without_a_decode_set_of_its_own_decode_follows_ops():
    engine = make_engine(linear_config(), **dataclasses.asdict(CONFIG))
    calls: list[tuple[str, int]] = []
    engine.runner.ops = counting(engine.runner.ops, calls, "replaced")
    assert engine.runner.decode_ops is engine.runner.ops
    engine.generate(PROMPT, GREEDY)
    assert [rows for _, rows in calls].count(1) > 3 * 2  # the decode passes' rows ran the replacement too
