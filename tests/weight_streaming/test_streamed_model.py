"""Streamed and resident runs of one checkpoint give identical tokens (and logits, bit for bit); a missed fetch is
a named error, never stale weights; the metrics land on the registry passed in."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from shard_svc.checkpoint.loader import load_model
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops
from shard_svc.weight_streaming import StreamingMetrics, StreamOptions, WeightStreamer
from shard_svc.weight_streaming.errors import MissingSlotError, StreamingConfigError
from shard_svc.weight_streaming.host import HostWeights
from shard_svc.weight_streaming.host_loader import load_streamed
from tests.engine.conftest import linear_config, random_model
from tests.weight_streaming.conftest import CPU

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(100, 140))]


def run(cfg, model, streamer=None, prompts=PROMPTS, max_tokens=4):
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU,
                    EngineConfig(num_state_slots=len(prompts), num_kv_blocks=64, prefill_token_budget=64))
    if streamer is not None:
        streamer.attach(engine.runner)
    seqs = [engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                               keep_prompt_logits=True) for i, p in enumerate(prompts)]
    passes = []
    while engine.has_work():
        engine.step()
        if streamer is not None:
            passes.append(streamer.last_pass)
    return seqs, passes


def assert_identical(resident, streamed):
    for a, b in zip(resident, streamed, strict=True):
        assert a.output == b.output, (a.request_id, a.output, b.output)
        assert torch.equal(torch.cat(a.prompt_logits), torch.cat(b.prompt_logits))
        assert torch.equal(torch.cat(a.step_logits), torch.cat(b.step_logits))


@pytest.fixture(scope="module")
def k3_resident(tiny_k3):
    cfg, model = load_model(tiny_k3, dtype=torch.float32)
    seqs, _ = run(cfg, model)
    return seqs


@pytest.mark.parametrize("depth,slots,expert_mode", [(2, None, "auto"), (1, 2, "routed"), (3, 5, "all")],
                         ids=["depth2-auto", "depth1-routed", "depth3-all"])
def test_k3_streamed_equals_resident(tiny_k3, k3_resident, depth, slots, expert_mode):
    """93 layers (24 MLA), MXFP4 experts streamed packed through the W4A16 path, ring wrapped ~30 times a pass."""
    cfg, model, host = load_streamed(tiny_k3, CPU, torch.float32)
    assert cfg.num_layers == 93 and cfg.quantization == "mxfp4"
    assert host.plans[5].experts.format == "mxfp4"
    # 8 experts, top-2: a decode step of 3 sequences is expected to touch 58% of them; stream routed ones below 70%.
    streamer = WeightStreamer(cfg, model, host, CPU, StreamOptions(prefetch_depth=depth, num_slots=slots,
                                                                   expert_mode=expert_mode, all_experts_share=0.7))
    seqs, passes = run(cfg, model, streamer)
    assert_identical(k3_resident, seqs)
    assert all(p.bytes > 0 for p in passes)
    routed = {p.routed for p in passes}
    assert routed == {"auto": {False, True}, "routed": {True}, "all": {False}}[expert_mode]
    dense = sum(len(plan.dense) for plan in host.plans.values())
    experts = sum(6 * plan.experts.num for plan in host.plans.values() if plan.experts)  # MXFP4: 3 x (packed, scale)
    assert experts == 92 * 8 * 6
    # A routed pass copies the dense tensors and only some experts; an all-experts pass every one. Each pass's count
    # is off by at most the first `depth` layers: the previous pass fetched them, this one fetches them for the next.
    first = sum(len(host.plans[layer].members()) for layer in sorted(host.plans)[:depth])
    for p in passes:
        if p.routed:
            assert dense - first < p.tensors < dense + experts
        else:
            assert dense + experts - first <= p.tensors <= dense + experts + first
    assert all(p.ahead == depth for p in passes) and [p.ready for p in passes] == [0] + [depth] * (len(passes) - 1)


def test_kimi_linear_bf16_experts_streamed_from_memory_equal_resident():
    """A model without a checkpoint (unquantised experts, plain residual path), streamed from its own weights."""
    raw = linear_config(num_hidden_layers=8, linear_attn_config={
        "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8]})
    cfg, model = random_model(raw, seed=3)
    resident, _ = run(cfg, model, prompts=[[5, 6, 7, 8], [9] * 20], max_tokens=5)
    cfg, model = random_model(raw, seed=3)
    host = HostWeights.from_model(cfg, model)
    streamer = WeightStreamer(cfg, model, host, CPU, StreamOptions(prefetch_depth=2))
    streamed, _ = run(cfg, model, streamer, prompts=[[5, 6, 7, 8], [9] * 20], max_tokens=5)
    assert_identical(resident, streamed)
    assert host.plans[1].experts.format == "dense"


@pytest.fixture
def k3_streamer(tiny_k3):
    cfg, model, host = load_streamed(tiny_k3, CPU, torch.float32)
    return cfg, model, WeightStreamer(cfg, model, host, CPU, StreamOptions(prefetch_depth=2))


def test_a_skipped_fetch_is_a_named_error_not_stale_weights(k3_streamer, monkeypatch, caplog):
    cfg, model, streamer = k3_streamer
    fetch = streamer._fetch
    monkeypatch.setattr(streamer, "_fetch", lambda layer, routed: None if layer == 40 else fetch(layer, routed))
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU, EngineConfig(num_state_slots=1, num_kv_blocks=16))
    streamer.attach(engine.runner)
    engine.add_request("x", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    result = engine.step()
    assert result.events[0].finish_reason == "error"
    assert "MissingSlotError" in result.events[0].error  # the client sees the class; the shard's log the detail
    assert any(r.exc_info and "layer 40" in str(r.exc_info[1]) for r in caplog.records)
    assert streamer.engine.occupancy() == 0  # the aborted pass left nothing behind


def test_streamed_weights_outside_a_pass_refuse_to_compute(k3_streamer):
    cfg, model, _ = k3_streamer
    q = model.model.layers[3].self_attn.q_a_proj.weight
    with pytest.raises(MissingSlotError, match=r"model\.layers\.3\.self_attn\.q_a_proj\.weight"):
        torch.nn.functional.linear(torch.ones(1, cfg.hidden_size), q)
    assert q.shape[1] == cfg.hidden_size  # metadata stays readable


def test_ring_smaller_than_the_prefetch_depth_is_refused(tiny_k3):
    cfg, model, host = load_streamed(tiny_k3, CPU, torch.float32)
    with pytest.raises(StreamingConfigError, match="depth \\+ 1 slots"):
        WeightStreamer(cfg, model, host, CPU, StreamOptions(prefetch_depth=3, num_slots=3))


def test_metrics_on_the_registry_passed_in(tiny_k3):
    registry = CollectorRegistry()
    cfg, model, host = load_streamed(tiny_k3, CPU, torch.float32)
    streamer = WeightStreamer(cfg, model, host, CPU, StreamOptions(prefetch_depth=2),
                              StreamingMetrics(registry, shard="s7"))
    run(cfg, model, streamer, prompts=[[1, 2, 3]], max_tokens=2)
    labels = {"shard": "s7", "rank": "0"}
    value = lambda name: registry.get_sample_value(name, labels)  # noqa: E731
    assert value("kimiserve_stream_bytes_total") > host.total_bytes  # a whole prefill pass, plus a decode pass
    assert value("kimiserve_stream_copy_seconds_count") == 2  # one observation per pass
    assert value("kimiserve_stream_compute_seconds_sum") > 0
    assert value("kimiserve_stream_stall_seconds_count") == 2
    assert value("kimiserve_stream_slots_total") == 3
    # sampled at the end of the last pass: the next pass's first two layers, fetched ahead
    assert value("kimiserve_stream_slots_used") == 2
    assert value("kimiserve_stream_fetched_ahead_layers_total") == 4  # two per pass
