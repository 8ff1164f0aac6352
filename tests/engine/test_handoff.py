"""Handing a sequence to another engine (shard_svc/engine/handoff.py, what a draining shard does): its state leaves
one engine mid-generation, travels as bytes, and the continuation on the other engine starts from it, prefilling
only the token sent last, and goes on exactly as the uninterrupted sequence would have, greedy and seeded, on both
model families. Without the state the same continuation must prefill everything (the test can tell the two apart).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shard_svc.engine.handoff import HandoffError, PackedState, StateStore, StatesFull
from shard_svc.engine.sampling import SamplingParams
from shard_svc.errors import InvalidRequest
from shard_svc.state.host_copy import HostCopyError
from tests.engine.conftest import k3_config, linear_config, make_engine

F64 = torch.float64  # the continuation reads one token the original decoded; in float64 the two paths agree
FAMILIES = {"kimi_linear": linear_config(), "k3": k3_config(8)}
PROMPT = [11, 4, 200, 37, 37, 90, 3, 150, 61, 8, 19, 240, 5, 77, 31, 2, 64]
MAX_TOKENS = 20
PARAMS = {"greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
          "seeded": SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=77)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> dict:
    return FAMILIES[request.param]


def run(engine, rid: str, prompt: list[int], params: SamplingParams, **kw) -> tuple[list[int], int]:
    """The sequence's output, and the prompt tokens prefill passes read for it."""
    seq = engine.add_request(rid, prompt, params, **kw)
    prefilled = 0
    while engine.has_work():
        for p in engine.step().passes:
            if p.kind == "prefill":
                prefilled += sum(n for r, n in zip(p.request_ids, p.seq_tokens) if r == rid)
    return seq.output, prefilled


def moved_after(engine, rid: str, prompt: list[int], params: SamplingParams, steps: int):
    """Runs the sequence for `steps` steps, then moves it out; returns its output so far, the Moved event and the
    state as it arrives at a peer (packed to bytes and unpacked)."""
    seq = engine.add_request(rid, prompt, params, movable=True)
    for _ in range(steps):
        engine.step()
    generated = list(seq.output)
    event, state = engine.move_out(rid)
    arrived = PackedState(state.tokens, state.pack().data).unpack("test") if state is not None else None
    return generated, event, arrived


@pytest.mark.parametrize("mode", list(PARAMS))
def test_a_moved_sequence_goes_on_exactly_and_prefills_one_token(family, mode):
    params = PARAMS[mode]
    whole, _ = run(make_engine(family, dtype=F64), "whole", PROMPT, params)
    source = make_engine(family, dtype=F64)
    free_slots = source.scheduler.slots.num_free
    generated, event, state = moved_after(source, "r", PROMPT, params, steps=6)
    assert len(generated) == 6 and generated == whole[:6]
    assert (event.finish_reason, event.moved_tokens) == ("moved", len(PROMPT) + 5)
    assert state.tokens == PROMPT + generated[:5], "the state holds all but the last token sent"
    assert not source.has_work() and source.scheduler.slots.num_free == free_slots, "its slot is freed"
    assert source.scheduler.blocks.num_free == source.scheduler.blocks.num_blocks

    peer = make_engine(family, dtype=F64)
    peer.add_request("other", [9, 8, 7, 6, 5], replace(PARAMS["greedy"], max_tokens=8))  # batched beside it
    rest = replace(params, max_tokens=MAX_TOKENS - 6)
    out, prefilled = run(peer, "r/failover-1", PROMPT + generated, rest, prior_output=6, imported=state)
    assert generated + out == whole
    assert prefilled == 1, f"only the last token sent is read again; {prefilled} were"
    recomputed, prefilled = run(make_engine(family, dtype=F64), "r/failover-1", PROMPT + generated, rest,
                                prior_output=6)
    assert generated + recomputed == whole and prefilled == len(PROMPT) + 6


def test_a_sequence_moved_mid_prefill_prefills_only_the_rest_of_its_prompt(family):
    params = PARAMS["greedy"]
    whole, _ = run(make_engine(family, dtype=F64), "whole", PROMPT, params)
    source = make_engine(family, dtype=F64, prefill_token_budget=8)
    generated, event, state = moved_after(source, "r", PROMPT, params, steps=1)
    assert generated == [] and event.moved_tokens == 8 and state.tokens == PROMPT[:8]
    out, prefilled = run(make_engine(family, dtype=F64), "r/failover-1", PROMPT, params, imported=state)
    assert out == whole and prefilled == len(PROMPT) - 8


def test_a_queued_sequence_moves_without_a_state():
    engine = make_engine(linear_config(), num_state_slots=1)
    engine.add_request("running", PROMPT, PARAMS["greedy"])
    engine.add_request("queued", PROMPT, PARAMS["greedy"], movable=True)
    engine.step()
    event, state = engine.move_out("queued")
    assert state is None and (event.finish_reason, event.moved_tokens, event.completion_tokens) == ("moved", 0, 0)
    assert "queued" not in engine.sequences and len(engine.scheduler.waiting) == 0


def test_a_state_that_does_not_begin_the_prompt_is_refused_naming_the_position():
    source = make_engine(linear_config())
    _, _, state = moved_after(source, "r", PROMPT, PARAMS["greedy"], steps=2)
    peer = make_engine(linear_config())
    wrong = PROMPT[:3] + [PROMPT[3] + 1] + PROMPT[4:] + [1, 2]
    with pytest.raises(InvalidRequest, match="differ from position 3") as e:
        peer.add_request("r/failover-1", wrong, PARAMS["greedy"], imported=state)
    assert e.value.param == "imported_state"
    with pytest.raises(InvalidRequest, match="be fewer"):  # nothing left to read: no logits to draw from
        peer.add_request("r/failover-1", list(state.tokens), PARAMS["greedy"], imported=state)


def test_a_state_of_another_model_shape_is_refused_naming_both_shapes():
    _, _, state = moved_after(make_engine(linear_config()), "r", PROMPT, PARAMS["greedy"], steps=2)
    wider = {**linear_config()["linear_attn_config"], "head_dim": 16}
    other = make_engine(linear_config(linear_attn_config=wider))
    shapes = r"its recurrent is \(3, 2, 8, 8\) torch.float32; this shard holds \(3, 2, 16, 16\)"  # 3 KDA layers
    with pytest.raises(HostCopyError, match=shapes):
        other.copier.check(state.host, len(state.tokens), "the state for 'r'")
    make_engine(linear_config()).copier.check(state.host, len(state.tokens), "the state for 'r'")  # its own fits


def test_malformed_state_bytes_are_refused():
    with pytest.raises(HandoffError, match="not a safetensors file"):
        PackedState([1, 2], b"\x00" * 40).unpack("the state for 'x'")


def test_the_store_hands_a_state_out_once_drops_it_after_the_hold_and_is_bounded():
    store = StateStore("test", max_states=2, hold_s=0.05)
    store.put("a", PackedState([1], b"x"))
    store.put("b", PackedState([1], b"y"))
    with pytest.raises(StatesFull, match="at most 2"):
        store.put("c", PackedState([1], b"z"))
    assert store.take("a").data == b"x" and store.take("a") is None
    assert store.wait_empty(1.0) == [] and store.expired == 1, "b was dropped unclaimed after the hold"
