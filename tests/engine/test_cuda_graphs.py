"""Decode graphs on the CPU: bucketing, padding rows, graph-safety declarations, and the padded persistent-buffer
path (run eagerly, `capture=False`) against the plain runner. Capture and replay themselves need a GPU: the
benchmark (bench/model_bench.py) checks graphs against eager logits there."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shard_svc.engine.cuda_graphs import (
    PAD_OWNER, CudaGraphError, CudaGraphRunner, TableStager, bucket_sizes, enable_cuda_graphs,
    graph_engine_config, pad_rows, pick_bucket, unsafe_decode_ops)
from shard_svc.engine.engine import EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.engine.step_rows import StepRow, build_rows
from shard_svc.ops import EAGER, Ops, select_ops
from tests.engine.conftest import k3_config, linear_config, make_engine

F64 = torch.float64


def test_bucket_sizes():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(5) == (1, 2, 4, 5)
    assert bucket_sizes(16) == (1, 2, 4, 8, 16)
    assert bucket_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    assert bucket_sizes(256)[-3:] == (224, 240, 256)
    assert bucket_sizes(0) == ()


def test_pick_bucket():
    buckets = (1, 2, 4, 8, 16, 32)
    assert [pick_bucket(n, buckets) for n in (1, 2, 3, 5, 16, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    assert pick_bucket(33, buckets) is None


def test_pad_rows_real_rows_first_then_padding():
    rows = [StepRow(tokens=[11], ctx_len=5, slot=3, table=[7, 9]), StepRow(tokens=[12], ctx_len=0, slot=1, table=[4])]
    padded = pad_rows(rows, bucket=4, width=8, block_size=4, pad_slot=0, pad_block=2)
    ids, ctx, slots, slot_mapping = padded.meta
    assert ids == [11, 12, 0, 0]
    assert ctx == [5, 0, 0, 0]
    assert slots == [3, 1, 0, 0]
    assert slot_mapping == [9 * 4 + 1, 4 * 4 + 0, 2 * 4, 2 * 4]  # position 5 lies in the second block
    assert padded.tables == [[7, 9], [4], [2], [2]] and padded.used == 2


def test_pad_rows_empty_step_is_all_padding():
    padded = pad_rows([], bucket=2, width=3, block_size=16, pad_slot=5, pad_block=1)
    assert padded.meta == [[0, 0], [0, 0], [5, 5], [16, 16]]
    assert padded.tables == [[1], [1]] and padded.used == 1


def test_table_stager_rewrites_only_changed_rows():
    stager = TableStager(rows=3, width=4, fill=9)
    a, b = [1, 2], [3]
    stager.stage([a, b, [9]])
    assert stager.host.tolist() == [[1, 2, 9, 9], [3, 9, 9, 9], [9, 9, 9, 9]] and stager.rewrites == 3
    stager.stage([a, b, [9]])
    assert stager.rewrites == 3, "unchanged tables are not rewritten"
    a.append(5)  # the sequence got a new block
    stager.stage([a, [3], [9]])
    assert stager.host[0].tolist() == [1, 2, 5, 9] and stager.rewrites == 4
    stager.stage([[3], [7, 8], [9]])  # the batch changed: same length as before in row 0, other blocks
    assert stager.host[:2].tolist() == [[3, 2, 5, 9], [7, 8, 9, 9]] and stager.rewrites == 6


def test_pad_rows_refusals():
    row = StepRow(tokens=[1], ctx_len=8, slot=0, table=[1, 2])
    with pytest.raises(CudaGraphError, match="bucket"):
        pad_rows([row] * 3, bucket=2, width=4, block_size=4, pad_slot=0, pad_block=0)
    with pytest.raises(CudaGraphError, match="captured width"):
        pad_rows([row], bucket=2, width=1, block_size=4, pad_slot=0, pad_block=0)
    with pytest.raises(CudaGraphError, match="past the sequence"):
        pad_rows([row], bucket=2, width=4, block_size=2, pad_slot=0, pad_block=0)
    with pytest.raises(CudaGraphError, match="one token"):
        pad_rows([StepRow(tokens=[1, 2], ctx_len=0, slot=0, table=[1])], bucket=1, width=4, block_size=4,
                 pad_slot=0, pad_block=0)


def test_graph_safety_declarations():
    eager = select_ops(torch.device("cpu"), "eager")
    # the eager references of these loop over sequences on the host (.tolist())
    assert unsafe_decode_ops(eager) == ["short_conv", "kda_decode", "mla_decode", "moe_experts"]

    def safe(*_):
        return None

    safe.graph_safe = True
    impls = dict(EAGER)
    impls.update({name: safe for name in ("short_conv", "kda_decode", "mla_decode", "moe_experts")})
    assert unsafe_decode_ops(Ops(**impls)) == []
    impls["moe_route"] = lambda *a: EAGER["moe_route"](*a)  # an undeclared wrapper is not trusted
    assert unsafe_decode_ops(Ops(**impls)) == ["moe_route"]


def test_graph_engine_config_adds_the_padding_slot_and_block():
    cfg = EngineConfig(num_state_slots=8, num_kv_blocks=100)
    assert graph_engine_config(cfg, torch.device("cpu"), enforce_eager=False) == cfg
    assert graph_engine_config(cfg, torch.device("cuda"), enforce_eager=True) == cfg
    graphs = graph_engine_config(cfg, torch.device("cuda"), enforce_eager=False)
    assert (graphs.num_state_slots, graphs.num_kv_blocks) == (9, 101)
    assert dataclasses.replace(graphs, num_state_slots=8, num_kv_blocks=100) == cfg


def test_enable_is_off_on_the_cpu():
    engine = make_engine(linear_config())
    assert enable_cuda_graphs(engine) is None and engine.runner.graphs is None


CONFIGS = {"linear": linear_config(), "k3-14": k3_config(14)}  # 14 layers: two attention-residual blocks
PROMPTS = [(21, 5), (5, 3), (30, 7)]  # (prompt length, tokens to generate): the decode batch shrinks 3 -> 2 -> 1


def run(engine, seed=0, prompts=PROMPTS):
    """Random prompts of these (length, tokens to generate), greedy, to completion; their sequences."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [engine.add_request(f"r{i}", torch.randint(0, 255, (n,), generator=gen).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True), keep_prompt_logits=True)
            for i, (n, m) in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return seqs


@pytest.mark.parametrize("name", CONFIGS)
def test_padded_buffers_match_the_plain_runner(name):
    """The graph path's persistent buffers and padding rows (run eagerly here) give the plain runner's logits."""
    kw = dict(num_kv_blocks=64, kv_block_size=4, prefill_token_budget=1000)
    plain = run(make_engine(CONFIGS[name], dtype=F64, num_state_slots=3, **kw))
    engine = make_engine(CONFIGS[name], dtype=F64, num_state_slots=4, **kw)  # one more: the padding slot
    runner = engine.runner
    graphs = CudaGraphRunner(runner, buckets=(1, 2, 4), max_blocks_per_seq=32, capture=False)
    graphs.capture()
    runner.graphs = graphs
    assert runner.kv_cache.blocks.table(PAD_OWNER) == [graphs.pad_block]
    steps = []
    original = graphs.replay
    graphs.replay = lambda work: steps.append(len(work)) or original(work)
    seqs = run(engine)
    # every decode step went through the graph path (the first token of each sequence comes from prefill)
    assert sum(steps) == sum(m - 1 for _, m in PROMPTS) and steps[0] == 3 and steps[-1] == 1
    for a, b in zip(plain, seqs, strict=True):
        assert a.output == b.output
        ref, got = torch.cat(a.step_logits), torch.cat(b.step_logits)
        assert ((got - ref).abs().max() / ref.abs().max()) <= 1e-9
    # only the padding rows used the padding slot and block; every sequence's slot was handed back
    assert runner.kda_pool.slots.num_free == 3


def test_replay_refuses_multi_token_rows():
    engine = make_engine(linear_config(), num_state_slots=2, num_kv_blocks=16, kv_block_size=4)
    graphs = CudaGraphRunner(engine.runner, buckets=(1,), max_blocks_per_seq=4, capture=False)
    graphs.capture()
    seq = engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    engine.scheduler.schedule()
    with pytest.raises(CudaGraphError, match="one token"):
        graphs.replay([(seq, 2)])


def test_build_rows_prepares_the_pools_and_slices_prompt_then_output():
    """The one row builder both paths use: a fresh sequence's slot is zeroed, cache room is reserved for exactly
    the new tokens, and the token ids cross from the prompt into the output at the right position."""
    engine = make_engine(linear_config(), num_state_slots=2, num_kv_blocks=16, kv_block_size=4)
    runner = engine.runner
    seq = engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.scheduler.schedule()
    runner.kda_pool.recurrent[:, seq.slot].fill_(3.0)  # stale state a fresh sequence must not see
    (row,) = build_rows([(seq, 3)], runner.kda_pool, runner.kv_cache)
    assert (row.tokens, row.ctx_len, row.slot) == ([5, 6, 7], 0, seq.slot)
    assert not runner.kda_pool.recurrent[:, seq.slot].any()
    assert len(row.table) == 1 and row.slot_mapping(4) == [row.table[0] * 4 + i for i in range(3)]
    seq.num_computed, seq.output = 5, [42, 43]  # prompt done, two tokens drawn: the next rows cross into output
    runner.kda_pool.recurrent[:, seq.slot].fill_(3.0)
    (row,) = build_rows([(seq, 2)], runner.kda_pool, runner.kv_cache)
    assert (row.tokens, row.ctx_len) == ([42, 43], 5) and len(row.table) == 2  # positions 5, 6: the second block
    assert row.slot_mapping(4) == [row.table[1] * 4 + 1, row.table[1] * 4 + 2]
    assert runner.kda_pool.recurrent[:, seq.slot].eq(3.0).all(), "a running sequence's state is left alone"
