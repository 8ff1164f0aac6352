"""Prefill graphs on the CPU: token buckets, when a pass may use them, and the padded persistent-buffer path with its
attention breaks (run eagerly, `capture=False`) against the plain runner. Capture and replay need a GPU:
tests/kernels/test_mla_moe_in_model.py captures them there, and bench/pass_overhead.py times them."""

from __future__ import annotations

import pytest
import torch

from shard_svc.engine.cuda_graphs import CudaGraphError, CudaGraphRunner
from shard_svc.engine.prefill_graphs import MAX_SEQS, PrefillGraphRunner, enable_prefill_graphs, token_buckets
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops
from tests.engine.conftest import k3_config, linear_config, make_engine
from tests.engine.test_cuda_graphs import run

F64 = torch.float64


def test_token_buckets():
    assert token_buckets(0) == ()
    assert token_buckets(16) == (16,)
    assert token_buckets(256) == (16, 32, 64, 128, 256)
    for bad in (8, 48, 100):
        with pytest.raises(ValueError, match="power of two"):
            token_buckets(bad)


def with_prefill_graphs(engine, buckets=(16, 32)) -> PrefillGraphRunner:
    """Decode graph buffers (for their padding slot and block) and prefill graph buffers, run eagerly."""
    decode = CudaGraphRunner(engine.runner, buckets=(1, 2, 4), max_blocks_per_seq=32, capture=False)
    decode.capture()
    engine.runner.graphs = decode
    graphs = PrefillGraphRunner(engine.runner, buckets, decode.width, decode.pad_slot, decode.pad_block,
                                capture=False)
    graphs.capture()
    engine.runner.prefill_graphs = graphs
    return graphs


# (prompt length, tokens to generate): with a 24-token budget the long prompts prefill in several passes, some of
# several sequences at once, the last of each ending mid-bucket; 40 tokens at once would not fit the buckets.
PROMPTS = [(21, 4), (5, 3), (30, 5), (2, 2), (17, 3)]


CONFIGS = {"linear": linear_config(), "k3-14": k3_config(14)}


@pytest.mark.parametrize("name", CONFIGS)
def test_padded_prefill_buffers_match_the_plain_runner(name):
    """Prompt and step logits through the prefill graph path (padding tokens, empty sequence entries, attention on
    the real rows between the pieces) equal the plain runner's."""
    kw = dict(num_kv_blocks=96, kv_block_size=4, prefill_token_budget=24)
    plain = run(make_engine(CONFIGS[name], dtype=F64, num_state_slots=len(PROMPTS), **kw), prompts=PROMPTS)
    engine = make_engine(CONFIGS[name], dtype=F64, num_state_slots=len(PROMPTS) + 1, **kw)
    graphs = with_prefill_graphs(engine)
    passes = []
    original = graphs.replay
    graphs.replay = lambda work: passes.append([n for _, n in work]) or original(work)
    seqs = run(engine, prompts=PROMPTS)
    assert passes and any(len(p) > 1 for p in passes), "several sequences shared a replayed pass"
    assert any(sum(p) not in graphs.buckets for p in passes), "a replayed pass was padded"
    for a, b in zip(plain, seqs, strict=True):
        assert a.output == b.output
        for got, ref in ((b.prompt_logits, a.prompt_logits), (b.step_logits, a.step_logits)):
            ref, got = torch.cat(ref), torch.cat(got)
            assert ((got - ref).abs().max() / ref.abs().max()) <= 1e-9
    assert engine.runner.kda_pool.slots.num_free == len(PROMPTS)


def test_the_pass_record_says_which_passes_were_replayed():
    from shard_svc.engine.pass_record import PassRecord

    engine = make_engine(linear_config(), num_state_slots=3, num_kv_blocks=64, kv_block_size=4,
                         prefill_token_budget=24)
    with_prefill_graphs(engine, buckets=(16,))
    engine.add_request("long", list(range(1, 31)), SamplingParams(temperature=0.0, max_tokens=1))
    engine.add_request("short", list(range(1, 6)), SamplingParams(temperature=0.0, max_tokens=1))
    records = []
    while engine.has_work():
        records += [PassRecord.of(p) for p in engine.step().passes if p.kind == "prefill"]
    # 24 of "long" (above the bucket: op by op), then its last 6 with "short" (11 tokens: replayed)
    assert [(r.tokens, r.graphed) for r in records] == [(24, 0), (11, 1)]
    assert PassRecord.from_ints("prefill", records[1].to_ints(), 0, 1).graphed == 1


def test_passes_that_do_not_fit_run_eagerly():
    engine = make_engine(linear_config(), num_state_slots=MAX_SEQS + 2, num_kv_blocks=128, kv_block_size=4,
                         prefill_token_budget=64)
    graphs = with_prefill_graphs(engine, buckets=(16,))
    run(engine, prompts=[(20, 1)])  # 20 tokens: above the only bucket
    assert graphs.replays == 0
    run(engine, prompts=[(1, 1)] * (MAX_SEQS + 1), seed=1)  # one sequence more than a captured pass holds
    assert graphs.replays == 0
    run(engine, prompts=[(1, 1)] * MAX_SEQS, seed=2)
    assert graphs.replays == 1


def test_replay_refuses_what_was_not_captured():
    engine = make_engine(linear_config(), num_state_slots=3, num_kv_blocks=64, kv_block_size=4)
    graphs = with_prefill_graphs(engine, buckets=(16,))
    seq = engine.add_request("a", list(range(1, 21)), SamplingParams(temperature=0.0, max_tokens=1))
    engine.scheduler.schedule()
    with pytest.raises(CudaGraphError, match="no captured prefill graph for 20 tokens"):
        graphs.replay([(seq, 20)])
    narrow = PrefillGraphRunner(engine.runner, (16,), 2, graphs.pad_slot, graphs.pad_block, capture=False)
    narrow.capture()
    with pytest.raises(CudaGraphError, match="exceeds the captured width 2"):
        narrow.replay([(seq, 12)])  # 12 tokens of 4 per block: 3 blocks


def test_enable_needs_graph_safe_prefill_ops_and_a_token_budget():
    engine = make_engine(linear_config(), num_state_slots=2, num_kv_blocks=16, kv_block_size=4)
    assert enable_prefill_graphs(engine, 4, 0, 0) is None, "the eager kda_prefill loops on the host"
    assert engine.runner.prefill_graphs is None
    off = make_engine(linear_config(), num_state_slots=2, num_kv_blocks=16, kv_block_size=4, prefill_graph_tokens=0)
    assert enable_prefill_graphs(off, 4, 0, 0) is None
    assert not hasattr(select_ops(torch.device("cpu"), "eager").kda_prefill, "graph_safe")
