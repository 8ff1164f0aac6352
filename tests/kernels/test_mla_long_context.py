"""The long-sequence MLA prefill (shard_svc/ops/mla/long_context.py): the context attended unmasked a workspace at a
time, the new tokens causally, merged by log-sum-exp; against the eager MLA attention.

On the CPU the attention library is `math_attend` (the parts and their merge are what is under test); on a GPU the
same cases run through cuDNN (`ops/mla/cudnn.py`), which is also checked alone against `math_attend`. The Triton
prefill's dispatch sends the sequences with enough new queries x cached keys to it and keeps the rest packed.
"""

from __future__ import annotations

import pytest
import torch

from shard_svc.ops.mla import eager
from shard_svc.ops.mla.long_context import math_attend, prefill_sequence
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close

FP32_TOL = 3e-3 if ON_GPU else 1e-5  # the GPU's fp32 dots are TF32
from tests.kernels.test_mla_prefill import make_prefill_batch, prefill_module

ATTENDS = {"math": math_attend}
if ON_GPU:
    from shard_svc.ops.mla.cudnn import cudnn_attend

    ATTENDS["cudnn"] = cudnn_attend

# (ctx, new, nh, nope, rope, v, kv_lora, block_size, workspace)
SEQUENCES = {
    "no-context": (0, 37, 3, 16, 8, 16, 32, 4, 16),
    "context-in-3-parts": (50, 20, 2, 16, 8, 24, 40, 8, 16),
    "context-whole": (50, 20, 2, 16, 8, 24, 40, 8, 1000),
    "one-query-workspace-7": (33, 1, 4, 16, 16, 16, 32, 4, 7),
}
if ON_GPU:
    SEQUENCES["kimi-48b-ctx-70k-chunk-2k"] = (70000, 2048, 32, 128, 64, 128, 512, 64, 32768)


@pytest.mark.parametrize("attend", list(ATTENDS))
@pytest.mark.parametrize("case", list(SEQUENCES))
def test_one_sequence_matches_eager(case, attend):
    ctx, n, nh, nope, rope, v_dim, kv_lora, bs, workspace = SEQUENCES[case]
    dtype = torch.bfloat16 if attend == "cudnn" else torch.float32
    if attend == "cudnn" and min(nope + rope, v_dim) < 64:
        pytest.skip("cuDNN is checked at model head widths")
    q_nope, q_pe, cache, w_kv_b, tables, ctx_lens, cu = make_prefill_batch([ctx], [n], nh, nope, rope, v_dim,
                                                                            kv_lora, bs, dtype)
    scale = (nope + rope) ** -0.5
    out = prefill_sequence(q_nope, q_pe, cache, w_kv_b, tables[0], ctx, scale, ATTENDS[attend], workspace)
    ref = eager.mla_attention(q_nope, q_pe, cache, w_kv_b, tables, ctx_lens, cu, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(f"{case} {attend}", out, ref, FP32_TOL if dtype == torch.float32 else 2e-2)


def test_the_dispatch_sends_long_sequences_to_the_library_and_keeps_the_rest_packed():
    """Sequences whose new queries x cached keys reach long_pairs go to the library, one call per part; the others
    (a decode row at a longer context, prompts without one) stay in the Triton kernel; the pass matches eager."""
    mod = prefill_module()
    calls: list[tuple[int, int, bool]] = []  # (queries, keys, causal) of each library call

    def recording(q, k, v, causal, scale):
        calls.append((q.shape[0], k.shape[0], causal))
        return math_attend(q, k, v, causal, scale)

    # new x cached: 1 x 40 (a decode row), 30 x 30, 8 x 0, 25 x 0
    args = make_prefill_batch([40, 30, 0, 0], [1, 30, 8, 25], 3, 16, 8, 16, 32, 4, torch.float32, seed=5)
    out = mod.mla_prefill(*args, 0.25, block_m=16, block_n=16, workspace_tokens=16, long_attend=recording,
                          long_pairs=600)
    assert_close("dispatch", out, eager.mla_attention(*args, 0.25), FP32_TOL)
    # the 30-token chunk at context 30: 16 + 14 context keys, then itself
    assert calls == [(30, 16, False), (30, 14, False), (30, 30, True)]


def test_without_a_library_every_sequence_stays_in_the_kernel():
    mod = prefill_module()
    args = make_prefill_batch([40, 0], [3, 25], 2, 16, 8, 16, 32, 4, torch.float32, seed=6)
    assert_close("no library", mod.mla_prefill(*args, 0.25, block_m=16, block_n=16, long_pairs=1),
                 eager.mla_attention(*args, 0.25), FP32_TOL)


@pytest.mark.skipif(not ON_GPU, reason="cuDNN needs the GPU")
@pytest.mark.parametrize("m, n, causal", [(8192, 8192, True), (512, 40000, False), (100, 100, True)])
def test_cudnn_attend_matches_math_at_the_48b_head_shape(m, n, causal):
    g = torch.Generator(device=DEVICE).manual_seed(m + n)
    q = torch.randn(m, 32, 192, device=DEVICE, generator=g).bfloat16()
    k = torch.randn(n, 32, 192, device=DEVICE, generator=g).bfloat16()
    v = torch.randn(n, 32, 128, device=DEVICE, generator=g).bfloat16()
    o, lse = cudnn_attend(q, k, v, causal, 192 ** -0.5)
    ref_o, ref_lse = math_attend(q, k, v, causal, 192 ** -0.5)
    assert_close("cudnn o", o, ref_o, 2e-2)
    assert (lse - ref_lse).abs().max().item() < 2e-2


@pytest.mark.skipif(not ON_GPU, reason="the served op's library is cuDNN on the GPU")
def test_served_op_mixes_cudnn_and_the_kernel_exactly():
    from shard_svc.ops import select_ops

    ops = select_ops(DEVICE, "triton")
    # a 2,048-token chunk at context 40,000 (cuDNN, two context segments, at a threshold lowered to keep eager
    # affordable), a short prompt and a decode row (kernel)
    args = make_prefill_batch([40000, 0, 100], [2048, 16, 1], 32, 128, 64, 128, 512, 64, torch.bfloat16)
    assert_close("served", ops.mla_prefill(*args, 192 ** -0.5, long_pairs=1 << 26),
                 eager.mla_attention(*args, 192 ** -0.5), 2e-2)


def test_chunked_prompts_through_an_engine_match_eager():
    """A tiny model's engine with a 16-token prefill budget: two prompts prefill over several passes at growing
    context, through the kernel with 8-key segments and, once a pass reaches 16 x 16 new x cached, the library path;
    greedy tokens and prompt logits equal the eager engine's."""
    import dataclasses
    import functools

    from shard_svc.engine.engine import Engine, EngineConfig
    from shard_svc.engine.sampling import SamplingParams
    from shard_svc.ops import select_ops
    from tests.engine.conftest import linear_config, random_model

    mod = prefill_module()
    calls: list[tuple[int, int, bool]] = []

    def recording(q, k, v, causal, scale):
        calls.append((q.shape[0], k.shape[0], causal))
        return math_attend(q, k, v, causal, scale)

    eager_ops = select_ops(DEVICE, "eager")
    bounded = dataclasses.replace(eager_ops, mla_prefill=functools.partial(
        mod.mla_prefill, block_m=16, block_n=16, workspace_tokens=8, long_attend=recording, long_pairs=256))
    prompts = [[(7 * i) % 200 + 1 for i in range(45)], [(11 * i) % 200 + 3 for i in range(21)]]
    runs = []
    for ops in (eager_ops, bounded):
        cfg, model = random_model(linear_config(), seed=0)
        engine = Engine(cfg, model.to(DEVICE), ops, DEVICE, EngineConfig(num_state_slots=4, num_kv_blocks=64,
                                                                         kv_block_size=4, prefill_token_budget=16))
        seqs = [engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                                   keep_prompt_logits=True) for i, p in enumerate(prompts)]
        while engine.has_work():
            engine.step()
        runs.append(seqs)
    assert calls and all(keys <= 8 for _, keys, causal in calls if not causal)  # the library saw bounded parts
    for a, b in zip(*runs, strict=True):
        assert a.output == b.output and a.finish_reason == b.finish_reason == "length"
        assert_close(f"prompt logits {a.request_id}", torch.cat(b.prompt_logits), torch.cat(a.prompt_logits),
                     2e-3 if ON_GPU else 1e-4)
