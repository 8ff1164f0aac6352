"""Capacity from memory (shard_svc/engine/capacity.py, memory_profile.py, sizing.py), on the CPU with made-up memory
reports: unit sizes against the real pools' layout, the split, flags that win, refusals naming sizes, host KV auto,
and the probe run end to end on a tiny model with a fake meter."""

from __future__ import annotations

import dataclasses
import functools
import logging

import pytest
import torch

from bench.configs import KIMI_LINEAR_48B
from shard_svc.config import ModelConfig
from shard_svc.engine.capacity import (
    MIN_AUTO_PREFIX_ENTRIES, CapacityDoesNotFit, CapacityRequest, MemoryReport, UnitSizes, cpu_plan, plan_from_memory,
    plan_host_kv)
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.memory_profile import MemoryProbeFailed, attention_peak_context
from shard_svc.engine.sizing import sized_config
from shard_svc.ops import select_ops
from shard_svc.state.pools import KDAStatePool, MLAKVCache
from tests.engine.conftest import k3_config, linear_config, random_model

GiB = 1 << 30
MiB = 1 << 20
CFG_48B = ModelConfig.from_dict(dict(KIMI_LINEAR_48B))
SIZES_48B = UnitSizes.for_model(CFG_48B, torch.bfloat16, 64)
# An H200 at the 48B shape (issue 25): 139.8 GiB total, 91.5 GiB in use once the weights are placed.
H200 = MemoryReport("cuda:0", int(139.8 * GiB), int(91.5 * GiB), 6 * GiB, 1 * GiB)


@pytest.mark.parametrize("raw", [dict(KIMI_LINEAR_48B), k3_config(layers=93)], ids=["48b", "k3-93"])
def test_unit_sizes_are_the_pools_own_bytes(raw):
    """Per-slot and per-block bytes equal what the real pools allocate for that model (built on the meta device)."""
    cfg = ModelConfig.from_dict(raw)
    sizes = UnitSizes.for_model(cfg, torch.bfloat16, 64)
    pool = KDAStatePool(cfg, 3, torch.device("meta"), conv_dtype=torch.bfloat16)
    cache = MLAKVCache(cfg, 5, 64, torch.device("meta"), torch.bfloat16)
    assert sizes.state_slot_bytes == pool.bytes_per_slot
    assert sizes.kv_block_bytes * 5 == cache.kv.numel() * cache.kv.element_size()
    assert sizes.counts_row_bytes == cfg.vocab_size * 5 and sizes.logits_row_bytes == cfg.vocab_size * 4


def test_48b_sizes_match_the_documented_figures():
    """README: a KDA state slot is about 41 MiB at the 48B shape, and KV is 8,064 B per token (7 MLA layers x 576
    x 2 bytes)."""
    assert SIZES_48B.state_slot_bytes == 20 * (32 * 128 * 128 * 4 + 3 * 32 * 128 * 3 * 2) == 43_417_600  # 20 KDA
    assert 40 * MiB < SIZES_48B.state_slot_bytes < 42 * MiB
    assert SIZES_48B.kv_block_bytes == 8064 * 64


def test_h200_48b_split():
    """The documented split on the issue's H200: the 256-slot cap, one entry per 4 slots, the rest in whole KV
    blocks (8,064 B a token); a 256k-token sequence fits many times over."""
    plan = plan_from_memory(CapacityRequest(), SIZES_48B, H200, model_max_len=1 << 20)
    budget = int(0.9 * 139.8 * GiB) - int(91.5 * GiB) - 7 * GiB  # 27.32 GiB
    assert (plan.num_state_slots, plan.prefix_cache_entries) == (256, 64)
    state = 256 * (43_417_600 + 163_840 * 5) + 64 * (43_417_600 + 163_840 * 9)
    assert plan.num_kv_blocks == (budget - state) // (8064 * 64) == 29329
    assert plan.max_model_len == 1 << 20  # the model's own: the cache holds 1.88M tokens
    assert plan.prefill_token_budget == 8192
    assert "from memory" in plan.why and "budget 27.32 GiB" in plan.why


def test_smaller_gpu_state_share_limits_the_slots():
    """8 GiB of budget: state gets half (77 slots and 20 entries of ~42 MiB), KV the rest."""
    plan = plan_from_memory(CapacityRequest(), SIZES_48B, MemoryReport("cuda:0", 80 * GiB, 60 * GiB, 4 * GiB),
                            model_max_len=1 << 20)
    assert (plan.num_state_slots, plan.prefix_cache_entries, plan.num_kv_blocks) == (77, 20, 8304)
    assert plan.max_model_len == 8304 * 64


def test_explicit_flags_win_and_come_off_the_budget_first():
    request = CapacityRequest(num_state_slots=64, prefix_cache_entries=4, prefill_token_budget=2048)
    plan = plan_from_memory(request, SIZES_48B, H200, model_max_len=1 << 20)
    assert (plan.num_state_slots, plan.prefix_cache_entries, plan.prefill_token_budget) == (64, 4, 2048)
    budget = int(0.9 * 139.8 * GiB) - int(91.5 * GiB) - 7 * GiB
    state = 64 * SIZES_48B.running_slot_bytes + 4 * SIZES_48B.entry_bytes
    assert plan.num_kv_blocks == (budget - state) // SIZES_48B.kv_block_bytes
    fixed = plan_from_memory(CapacityRequest(num_kv_blocks=1000, max_model_len=32768), SIZES_48B, H200, 1 << 20)
    assert fixed.num_kv_blocks == 1000 and fixed.max_model_len == 32768
    # state may then take what the blocks leave, up to the cap of 256 running slots
    assert fixed.num_state_slots == 256 and fixed.prefix_cache_entries == 64


def test_few_explicit_slots_still_keep_a_floor_of_prefix_entries():
    """One entry per 4 slots gives a 4-slot shard one entry, which each prompt's own end would evict before the next
    request could restore its system prompt's point; the floor keeps MIN_AUTO_PREFIX_ENTRIES while the state share
    holds them, and never pushes KV below what the share leaves it."""
    plan = plan_from_memory(CapacityRequest(num_state_slots=4), SIZES_48B, H200, 1 << 20)
    assert (plan.num_state_slots, plan.prefix_cache_entries) == (4, MIN_AUTO_PREFIX_ENTRIES)
    # 2 GiB of budget: half of it holds 4 running slots and 19 entries' worth, so the floor stays 16; at 0.6 GiB the
    # share (0.3 GiB) holds 4 slots and 3 entries, and the floor is what fits.
    for budget_gib, entries in ((2.0, 16), (0.6, 3)):
        report = MemoryReport("cuda:0", 80 * GiB, int((72 - budget_gib) * GiB), 0)
        plan = plan_from_memory(CapacityRequest(num_state_slots=4), SIZES_48B, report, model_max_len=4096)
        assert plan.prefix_cache_entries == entries, budget_gib
        share_left = int(0.5 * int(0.9 * 80 * GiB - int((72 - budget_gib) * GiB)))
        assert plan.num_state_slots * SIZES_48B.running_slot_bytes + entries * SIZES_48B.entry_bytes <= share_left


def test_utilization_scales_the_budget():
    low = plan_from_memory(CapacityRequest(gpu_memory_utilization=0.75), SIZES_48B, H200, 1 << 20)
    high = plan_from_memory(CapacityRequest(), SIZES_48B, H200, 1 << 20)
    assert low.num_state_slots < high.num_state_slots and low.num_kv_blocks < high.num_kv_blocks


def test_small_model_hits_the_slot_cap_and_kv_takes_the_rest():
    cfg = ModelConfig.from_dict(linear_config())
    sizes = UnitSizes.for_model(cfg, torch.float32, 16)
    report = MemoryReport("cuda:0", 80 * GiB, 2 * GiB, GiB)
    plan = plan_from_memory(CapacityRequest(), sizes, report, model_max_len=4096)
    assert (plan.num_state_slots, plan.prefix_cache_entries) == (256, 64)
    assert plan.max_model_len == 4096  # the model's own maximum: the KV cache holds far more
    state = 256 * sizes.running_slot_bytes + 64 * sizes.entry_bytes
    assert plan.num_kv_blocks == (int(0.9 * 80 * GiB) - 3 * GiB - state) // sizes.kv_block_bytes


def test_one_sequence_that_cannot_fit_is_refused_naming_sizes():
    tight = MemoryReport("cuda:0", int(100 * GiB), int(89.9 * GiB), 0)  # 0.1 GiB left at 0.9
    with pytest.raises(CapacityDoesNotFit) as e:
        plan_from_memory(CapacityRequest(max_model_len=256 * 1024), SIZES_48B, tight, 1 << 20)
    msg = str(e.value)
    assert "not even one sequence fits" in msg and "262144 tokens" in msg and "4096 KV blocks" in msg
    assert "(42.19 MiB)" in msg and "0.10 GiB" in msg and "--gpu-memory-utilization" in msg
    with pytest.raises(CapacityDoesNotFit, match="activation peak"):
        plan_from_memory(CapacityRequest(), SIZES_48B, MemoryReport("cuda:0", 100 * GiB, 85 * GiB, 6 * GiB), 1 << 20)


def test_flags_over_the_budget_are_refused_naming_them():
    with pytest.raises(CapacityDoesNotFit) as e:
        plan_from_memory(CapacityRequest(num_state_slots=1024), SIZES_48B, H200, 1 << 20)
    assert "--num-state-slots 1024" in str(e.value) and "budget 27.32 GiB" in str(e.value)
    with pytest.raises(CapacityDoesNotFit, match="must be in"):
        plan_from_memory(CapacityRequest(gpu_memory_utilization=1.5), SIZES_48B, H200, 1 << 20)


def test_host_kv_offload_gives_state_a_larger_share():
    small_gpu = MemoryReport("cuda:0", 48 * GiB, 30 * GiB, 2 * GiB)
    plain = plan_from_memory(CapacityRequest(), SIZES_48B, small_gpu, 1 << 20)
    with_host = plan_from_memory(CapacityRequest(), SIZES_48B, small_gpu, 1 << 20, host_kv=True)
    assert with_host.num_state_slots > plain.num_state_slots and with_host.num_kv_blocks < plain.num_kv_blocks


def test_host_kv_auto_takes_half_the_available_host_memory_in_pages():
    page = 8064 * 64
    assert plan_host_kv(None, 100 * GiB, page)[0] == (50 * GiB // page) * page
    assert plan_host_kv(3 * GiB, 1 * GiB, page)[0] == 3 * GiB  # a number is taken as is (checked at allocation)
    with pytest.raises(CapacityDoesNotFit, match="holds no KV page"):
        plan_host_kv(None, page, page)


def test_block_size_is_64_tokens_where_sized_from_memory_and_16_elsewhere():
    assert (CapacityRequest().block_size(True), CapacityRequest().block_size(False)) == (64, 16)
    assert CapacityRequest(kv_block_size=32).block_size(True) == 32


def test_cpu_keeps_the_fixed_defaults():
    plan = cpu_plan(CapacityRequest(), 16, model_max_len=1 << 20, reason="device cpu is not measured")
    assert (plan.num_state_slots, plan.num_kv_blocks, plan.prefix_cache_entries, plan.prefill_token_budget,
            plan.max_model_len) == (16, 1024, 16, 512, 16384)
    plan = cpu_plan(CapacityRequest(num_state_slots=2, prefix_cache_entries=0, max_model_len=100), 16, 1 << 20, "x")
    assert (plan.num_state_slots, plan.prefix_cache_entries, plan.max_model_len) == (2, 0, 100)


class FakeMeter:
    """A device with `total` bytes of which `in_use` are taken; the probe's passes "allocate" `peak` above its
    pools. Counts what the probe asked of it."""

    def __init__(self, total: int, in_use: int, peak: int):
        self.device, self.total, self.in_use, self.extra = "fake:0", total, in_use, peak
        self.resets = self.releases = 0

    def total_and_free(self) -> tuple[int, int]:
        return self.total, self.total - self.in_use

    def allocated(self) -> int:
        return self.in_use

    def reset_peak(self) -> None:
        self.resets += 1

    def peak(self) -> int:
        return self.in_use + self.extra

    def release(self) -> None:
        self.releases += 1


def test_probe_runs_on_a_tiny_model_and_sizes_the_engine(caplog):
    """sized_config with a meter runs the real probe (a full-budget prefill, then a decode batch of every slot the
    budget allows) on a tiny CPU model, frees it, and returns the plan's capacity."""
    cfg, model = random_model(linear_config())
    built: list[Engine] = []

    def build(config: EngineConfig) -> Engine:
        built.append(Engine(cfg, model, select_ops(torch.device("cpu"), "eager"), torch.device("cpu"), config))
        return built[-1]

    meter = FakeMeter(total=8 * GiB, in_use=7 * GiB, peak=100 * MiB)
    request = CapacityRequest(prefill_token_budget=64, max_model_len=512, kv_block_size=16)
    with caplog.at_level(logging.INFO, logger="shard_svc"):
        config = sized_config(request, EngineConfig(prefix_state_interval=64), cfg,
                              torch.device("cpu"), torch.float32, build, None, in_group=False, meter=meter)
    sizes = UnitSizes.for_model(cfg, torch.float32, 16)
    expected = plan_from_memory(request, sizes, MemoryReport("fake:0", 8 * GiB, 7 * GiB, 100 * MiB), 4096)
    assert (config.num_state_slots, config.num_kv_blocks, config.prefix_cache_entries,
            config.prefill_token_budget) == (expected.num_state_slots, expected.num_kv_blocks,
                                             expected.prefix_cache_entries, 64)
    assert config.kv_block_size == 16 and config.prefix_state_interval == 64 and config.max_model_len == 512
    probe = built[0]
    assert probe.engine_cfg.num_state_slots == 256 and not probe.has_work()  # every probe request finished
    assert probe.runner.kda_pool.slots.num_free == 256 and meter.resets == 1 and meter.releases == 1
    profiled = next(r for r in caplog.records if r.msg == "memory profiled")
    assert (profiled.prefill_tokens, profiled.decode_batch) == (64, 256)
    chosen = [r for r in caplog.records if r.msg == "capacity chosen"]
    assert len(chosen) == 1 and "from memory" in chosen[0].why and "host KV offload off" in chosen[0].why


@pytest.mark.parametrize("library_pairs, context", [(0, 512), (64 * 600, 768)], ids=["kernel", "library"])
def test_probe_runs_its_last_full_pass_past_the_attention_workspace(caplog, library_pairs, context):
    """An MLA prefill that expands at most 300 context keys at once (and, in the second case, hands a sequence to a
    library from 600 cached keys under a full pass of 64): the probe's prompt is long enough that its last pass runs
    the full prefill budget (64 tokens) past both, so the largest workspace is in the peak."""
    cfg, model = random_model(linear_config())
    passes: list[tuple[int, int]] = []  # (query tokens, longest context) of each prefill attention call

    def bounded_prefill(q_nope, q_pe, kv_cache, w_kv_b, block_tables, ctx_lens, cu_seqlens, scale, lengths=None):
        passes.append((q_nope.shape[0], int(ctx_lens.max())))
        return select_ops(torch.device("cpu"), "eager").mla_prefill(
            q_nope, q_pe, kv_cache, w_kv_b, block_tables, ctx_lens, cu_seqlens, scale, lengths=lengths)

    bounded_prefill.context_workspace_tokens = 300
    if library_pairs:
        bounded_prefill.long_context_pairs = library_pairs
    ops = dataclasses.replace(select_ops(torch.device("cpu"), "eager"), mla_prefill=bounded_prefill)
    assert attention_peak_context(ops, 64) == max(300, library_pairs // 64)
    assert attention_peak_context(select_ops(torch.device("cpu"), "eager"), 64) == 0

    def build(config: EngineConfig) -> Engine:
        return Engine(cfg, model, ops, torch.device("cpu"), config)

    request = CapacityRequest(prefill_token_budget=64, max_model_len=2048, kv_block_size=16)
    with caplog.at_level(logging.INFO, logger="shard_svc"):
        sized_config(request, EngineConfig(), cfg, torch.device("cpu"), torch.float32, build, None, in_group=False,
                     meter=FakeMeter(total=8 * GiB, in_use=7 * GiB, peak=100 * MiB),
                     peak_context=functools.partial(attention_peak_context, ops))
    profiled = next(r for r in caplog.records if r.msg == "memory profiled")
    # passes of 256 tokens (the probe's decode batch sets its budget) until the context is past the peak's
    assert profiled.prefill_context_tokens == context
    assert (64, context) in passes and max(ctx for _, ctx in passes) == context


def test_a_failed_probe_pass_is_an_error_not_a_smaller_peak():
    """The engine fails a pass's sequences and keeps serving; the probe must not then size from a peak that pass never
    reached."""
    cfg, model = random_model(linear_config())

    def breaks_at_context(q_nope, q_pe, kv_cache, w_kv_b, block_tables, ctx_lens, cu_seqlens, scale, lengths=None):
        if int(ctx_lens.max()) > 0:
            raise RuntimeError("library call failed at 512 keys")
        return select_ops(torch.device("cpu"), "eager").mla_prefill(
            q_nope, q_pe, kv_cache, w_kv_b, block_tables, ctx_lens, cu_seqlens, scale, lengths=lengths)

    breaks_at_context.context_workspace_tokens = 300
    ops = dataclasses.replace(select_ops(torch.device("cpu"), "eager"), mla_prefill=breaks_at_context)
    request = CapacityRequest(prefill_token_budget=64, max_model_len=2048, kv_block_size=16)
    with pytest.raises(MemoryProbeFailed, match=r"memory-probe-prefill \(576 prompt tokens, 1 of 257 .*RuntimeError"):
        sized_config(request, EngineConfig(), cfg, torch.device("cpu"), torch.float32,
                     lambda config: Engine(cfg, model, ops, torch.device("cpu"), config), None, in_group=False,
                     meter=FakeMeter(total=8 * GiB, in_use=7 * GiB, peak=100 * MiB),
                     peak_context=functools.partial(attention_peak_context, ops))


def test_shard_group_and_cpu_are_not_measured(caplog):
    cfg, model = random_model(linear_config())
    with caplog.at_level(logging.INFO, logger="shard_svc"):
        config = sized_config(CapacityRequest(), EngineConfig(kv_block_size=99), cfg, torch.device("cpu"),
                              torch.float32, lambda c: pytest.fail("no probe on the CPU"), None, in_group=False)
    assert (config.num_state_slots, config.num_kv_blocks, config.kv_block_size, config.prefix_cache_entries,
            config.prefill_token_budget) == (16, 1024, 16, 16, 512)
    assert "device cpu is not measured" in next(r for r in caplog.records if r.msg == "capacity chosen").why


def test_flags_that_cannot_fit_are_refused_before_the_probe_allocates():
    cfg = ModelConfig.from_dict(dict(KIMI_LINEAR_48B))
    meter = FakeMeter(total=int(139.8 * GiB), in_use=int(91.5 * GiB), peak=0)
    with pytest.raises(CapacityDoesNotFit, match="--num-state-slots 4096"):
        sized_config(CapacityRequest(num_state_slots=4096), EngineConfig(), cfg, torch.device("cpu"),
                     torch.bfloat16, lambda c: pytest.fail("the probe must not be built"), None, in_group=False,
                     meter=meter)
