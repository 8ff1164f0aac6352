"""Cross-pass prefetch: the next forward pass's first layers are fetched while this pass's last layers compute.

Observed through the native engine's calls (a recording proxy) and the streamer's per-pass stats, never through
timing: the ring keeps its order and never refills a slot before its layer's release, the next pass starts with its
first layers already fetched, the expert policy follows the engine's hint, and a failed pass leaves nothing behind.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops
from shard_svc.weight_streaming import StreamOptions, WeightStreamer
from shard_svc.weight_streaming.host import HostWeights
from tests.engine.conftest import linear_config, random_model
from tests.weight_streaming.conftest import CPU
from tests.weight_streaming.test_streamed_model import assert_identical

# 8 layers: layer 0 a dense MLP, 1-7 MoE (6 experts, top-2), MLA at 3 and 7.
RAW = linear_config(num_hidden_layers=8, linear_attn_config={
    "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3, 5, 6, 7],
    "full_attn_layers": [4, 8]})


class Recorder:
    """The native engine with its ring calls recorded; `pass` marks the start of each forward pass."""

    def __init__(self, engine):
        self._engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def reset_stats(self):
        self.calls.append(("pass",))
        self._engine.reset_stats()

    def fetch(self, layer, ids=None):
        slot = self._engine.fetch(layer, ids)
        self.calls.append(("fetch", layer, slot, ids is None))
        return slot

    def acquire(self, layer, stream=0):
        slot = self._engine.acquire(layer, stream)
        self.calls.append(("acquire", layer, slot))
        return slot

    def fetch_into(self, layer, ids, stream=0):
        copied = self._engine.fetch_into(layer, ids, stream)
        self.calls.append(("fetch_into", layer, copied))
        return copied

    def release(self, layer, stream=0):
        self._engine.release(layer, stream)
        self.calls.append(("release", layer))

    def passes(self) -> list[list[tuple]]:
        out: list[list[tuple]] = []
        for call in self.calls:
            if call[0] == "pass":
                out.append([])
            elif out:
                out[-1].append(call)
        return out


def streamed(layers=None, **options) -> tuple:
    """(cfg, model, streamer whose engine records its calls, the stats of every pass as it ends)."""
    cfg, model = random_model(RAW, seed=3)
    host = HostWeights.from_model(cfg, model, layers)
    streamer = WeightStreamer(cfg, model, host, CPU, StreamOptions(**options))
    streamer.engine = Recorder(streamer.engine)
    stats, scope = [], streamer.pass_scope

    @contextmanager
    def recorded(batch, num_tokens):
        try:
            with scope(batch, num_tokens):
                yield
        finally:
            stats.append(streamer.last_pass)

    streamer.pass_scope = recorded
    return cfg, model, streamer, stats


def drive(cfg, model, streamer=None, schedule=((("a", list(range(5, 13)), 6),),)) -> list:
    """Runs the engine to completion; schedule[i] lists (id, prompt, max_tokens) added before step i."""
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU,
                    EngineConfig(num_state_slots=4, num_kv_blocks=64, prefill_token_budget=64))
    if streamer is not None:
        streamer.attach(engine.runner)
    seqs, step = [], 0
    while step < len(schedule) or engine.has_work():
        for rid, prompt, max_tokens in (schedule[step] if step < len(schedule) else ()):
            seqs.append(engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                       ignore_eos=True),
                                           keep_prompt_logits=True))
        engine.step()
        step += 1
    return seqs


def test_the_next_pass_starts_with_its_first_layers_fetched():
    cfg, model, streamer, stats = streamed(prefetch_depth=2)
    (resident,) = drive(*random_model(RAW, seed=3))
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU, EngineConfig(num_state_slots=1, num_kv_blocks=16))
    streamer.attach(engine.runner)
    seq = engine.add_request("a", list(range(5, 13)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                             keep_prompt_logits=True)
    engine.step()  # the prefill pass
    held = {layer: state for layer, state in streamer.engine.slots_state() if layer >= 0}
    assert held == {0: "loading", 1: "loading"}, "the idle engine holds the next pass's first layers, not yet used"
    while engine.has_work():
        engine.step()
    assert [(p.ready, p.ahead) for p in stats] == [(0, 2)] + [(2, 2)] * 5
    for calls in streamer.engine.passes()[1:]:  # no pass fetched its own first layers: the previous one did
        before_first_acquire = calls[: next(i for i, c in enumerate(calls) if c[0] == "acquire")]
        assert not [c for c in before_first_acquire if c[0] == "fetch"]
    assert_identical([resident], [seq])


@pytest.mark.parametrize("layers,depth,slots", [(None, 2, None), (None, 3, 5), ([2, 5], 3, 4), ([4], 1, None)],
                         ids=["8-layers-depth2", "8-layers-depth3-5-slots", "depth-above-layers", "one-layer"])
def test_the_ring_keeps_its_order_across_passes_and_never_refills_a_slot_in_use(layers, depth, slots):
    cfg, model, streamer, passes = streamed(layers, prefetch_depth=depth, num_slots=slots)
    schedule = ((("a", list(range(5, 13)), 4), ("b", [40, 41, 42], 3)),)
    seqs = drive(cfg, model, streamer, schedule)
    resident = drive(*random_model(RAW, seed=3), schedule=schedule)
    assert_identical(resident, seqs)
    order, ring = streamer.order, streamer.engine.num_slots
    calls = [c for c in streamer.engine.calls if c[0] != "pass"]
    fetch_slots = [c[2] for c in calls if c[0] == "fetch"]
    assert fetch_slots == [i % ring for i in range(len(fetch_slots))], "round robin, continued across passes"
    occupant: dict[int, int] = {}  # slot -> layer fetched into it and not yet released
    where: dict[int, int] = {}
    for call in calls:
        if call[0] == "fetch":
            _, layer, slot, _ = call
            assert slot not in occupant, f"slot {slot} refilled with layer {layer} while {occupant.get(slot)} held it"
            occupant[slot], where[layer] = layer, slot
        elif call[0] == "acquire":
            assert call[2] == where[call[1]]
        elif call[0] == "release":
            del occupant[where.pop(call[1])]
    for p, calls in enumerate(streamer.engine.passes()):
        assert [c[1] for c in calls if c[0] == "acquire"] == order, f"pass {p} runs every streamed layer in order"
    expected_ahead = min(depth, len(order))
    assert all(p.ahead == expected_ahead for p in passes)
    assert [p.ready for p in passes] == [0] + [expected_ahead] * (len(passes) - 1)
    assert sorted(occupant.values()) == order[:expected_ahead]  # idle: only the next pass's first layers


def _ahead_fetches(calls: list[tuple], order: list[int]) -> list[tuple]:
    """The fetches of a pass issued for the next one: those of its first layers after they were acquired."""
    acquired: set[int] = set()
    out = []
    for c in calls:
        if c[0] == "acquire":
            acquired.add(c[1])
        elif c[0] == "fetch" and c[1] in acquired:
            out.append(c)
    return out


def test_the_expert_policy_across_passes_follows_the_plan_and_stays_exact():
    """6 experts, top-2, prefetch every expert from half of them touched: a pass of one token streams the routed
    experts, a pass of 8 or 20 every expert. Layer 0 has no experts; layer 1 is the first MoE layer."""
    cfg, model, streamer, passes = streamed(prefetch_depth=2, all_experts_share=0.5)
    schedule = ((("a", list(range(5, 13)), 5),), (), (("b", list(range(60, 80)), 2),))
    seqs = drive(cfg, model, streamer, schedule)
    resident = drive(*random_model(RAW, seed=3), schedule=schedule)
    assert_identical(resident, seqs)
    per_pass = streamer.engine.passes()
    # step 0: prefill a (all experts), no decode after it -> the next pass is assumed alike: layer 1 with every expert
    # step 1: decode a (routed) -> fetched ahead with the dense tensors only
    # step 2: prefill b (all experts) then decode a: b's pass completes layer 1's experts on acquiring it, and the
    #         engine says a one-token decode follows -> dense tensors only
    assert [p.routed for p in passes[:4]] == [False, True, False, True]
    full = {i: {c[1]: c[3] for c in _ahead_fetches(per_pass[i], streamer.order)} for i in range(4)}
    assert full[0] == {0: True, 1: True}
    assert full[1] == {0: True, 1: False}
    assert full[2] == {0: True, 1: False}
    copied = lambda i: [c for c in per_pass[i] if c[0] == "fetch_into" and c[2] > 0]  # noqa: E731
    expert_bytes = sum(m.nbytes for m in streamer.host.members(1) if m.expert is not None)
    assert copied(2) == [("fetch_into", 1, expert_bytes)], "the all-experts pass copies the experts layer 1 lacked"
    assert [c for c in copied(1) if c[1] == 1] == [], "a routed pass finds the experts fetched ahead in the slot"


def _logged_failure(caplog) -> str:
    """The client sees only the error's class; the whole message (layer, slot) is in the shard's log."""
    return "\n".join(str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_a_failed_pass_drops_what_was_fetched_ahead_and_the_next_starts_cold(monkeypatch, caplog):
    cfg, model, streamer, stats = streamed(prefetch_depth=2)
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU, EngineConfig(num_state_slots=2, num_kv_blocks=32))
    streamer.attach(engine.runner)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], params)
    engine.step()
    assert streamer.engine.occupancy() == 2
    fetch = streamer._fetch
    monkeypatch.setattr(streamer, "_fetch", lambda layer, routed: None if layer == 5 else fetch(layer, routed))
    (event,) = engine.step().events
    assert event.finish_reason == "error" and "MissingSlotError" in event.error
    assert "layer 5" in _logged_failure(caplog)
    assert streamer.engine.occupancy() == 0 and stats[-1].ahead == 0
    monkeypatch.setattr(streamer, "_fetch", fetch)
    seq = engine.generate([7, 8, 9], params, "b")
    assert len(seq.output) == 3
    assert [p.ready for p in stats[-3:]] == [0, 2, 2]  # cold after the failure, warm again after
    first = streamer.engine.passes()[-3]
    assert [c[1] for c in first if c[0] == "fetch"][:2] == [0, 1]  # the cold pass fetched its own first layers


def test_a_pass_that_skips_a_streamed_layer_is_a_named_error(monkeypatch, caplog):
    cfg, model, streamer, _ = streamed(prefetch_depth=2)
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU, EngineConfig(num_state_slots=1, num_kv_blocks=16))
    streamer.attach(engine.runner)
    # the last layer never runs
    monkeypatch.setattr(model.model.layers[7], "forward", lambda h, pending, ctx: (h, pending))
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    (event,) = engine.step().events
    assert event.finish_reason == "error"
    assert "UnusedPrefetchError" in event.error and "[7] fetched for it but never run" in _logged_failure(caplog)
    assert streamer.engine.occupancy() == 0
