"""Fair prefill sharing inside the engine (shard_svc/engine/prefill_share.py): decodes that ride in a long
prompt's prefill passes compute what a decode pass computes, and a short prompt is not held behind a long one."""

from __future__ import annotations

import pytest
import torch

from shard_svc.engine.sampling import SamplingParams
from tests.engine.conftest import k3_config, linear_config, make_engine
from tests.engine.test_invariants import assert_logits_close

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = [(7 * i) % 250 + 1 for i in range(200)]
SHORT = [5, 9, 2, 6, 5, 3]


def run_short(engine, with_long: bool) -> tuple:
    """Runs SHORT to its end (with the long prompt arriving after its first token when with_long); returns its
    sequence and the prefill passes that carried its decode steps."""
    seq = engine.add_request("short", SHORT, GREEDY, keep_prompt_logits=True)
    folded = 0
    engine.step()  # its prefill: the first token
    if with_long:
        engine.add_request("long", LONG, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while not seq.finished:
        for p in engine.step().passes:
            folded += p.kind == "prefill" and p.decode_rows
    while engine.has_work():
        engine.step()
    return seq, folded


@pytest.mark.parametrize("raw", [linear_config(), k3_config(layers=13)], ids=["kimi_linear", "kimi_k3"])
def test_decode_rows_in_a_prefill_pass_equal_a_decode_pass(raw):
    """In float64 (as tests/engine/test_invariants.py), so the prefill and decode kernels' different summation
    orders stay far below what a wrong state or cache position would change."""
    engine = lambda: make_engine(raw, dtype=torch.float64, num_state_slots=4, num_kv_blocks=64,  # noqa: E731
                                 prefill_token_budget=32, fold_decodes=True)
    alone, _ = run_short(engine(), False)
    mixed, folded = run_short(engine(), True)
    assert folded >= 5  # the long prompt took 7 passes of at most 32 tokens; the short one decoded in them
    assert mixed.output == alone.output
    assert_logits_close(torch.cat(mixed.step_logits), torch.cat(alone.step_logits))


def test_a_short_prompt_is_prefilled_beside_a_running_long_one():
    engine = make_engine(linear_config(), num_state_slots=4, num_kv_blocks=64, prefill_token_budget=32)
    engine.add_request("long", LONG, GREEDY)
    engine.step()
    engine.add_request("short", SHORT, GREEDY)
    passes = engine.step().passes
    prefill = next(p for p in passes if p.kind == "prefill")
    assert prefill.request_ids == ["long", "short"] and prefill.seq_tokens == [26, 6]  # the short prompt whole
    assert engine.sequences["short"].output  # its first token came out of that same pass


def test_decodes_have_their_own_pass_unless_folding_is_asked_for():
    engine = make_engine(linear_config(), num_state_slots=4, num_kv_blocks=64, prefill_token_budget=32)
    _, folded = run_short(engine, True)
    assert folded == 0
