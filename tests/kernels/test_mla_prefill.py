"""Triton MLA prefill (flash-style, causal, varlen, cached prefix) against the eager MLA attention.

Sequences with and without a cached prefix (chunked prefill), lengths off the query and key tile grid, empty
sequences, head counts that are not powers of two, rope/latent widths below a tensor-core tile, shuffled block
tables, and a cache whose unused blocks and positions are NaN. The bounded workspace: keys expanded a few at a time,
segments cut inside the cached prefix, inside the new tokens (query rows that see no key of a segment) and between
sequences, down to one key a segment, against the eager attention and against the single launch.
"""

from __future__ import annotations


import pytest
import torch

from shard_svc.ops.mla import eager
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, kernel_module

WHOLE = 1 << 30  # a workspace every case's keys fit in: one launch
# (ctx_lens, new lens, nh, nope, rope, v, kv_lora, block_size, dtype, block_m, workspace_tokens)
CASES = {
    "one-70-H3-no-prefix": ([0], [70], 3, 16, 8, 16, 32, 4, torch.float32, 16, WHOLE),
    "varlen-prefix-H5": ([0, 33, 5], [17, 40, 1], 5, 16, 8, 24, 40, 4, torch.float32, 16, WHOLE),
    "empty-seq-H2-block16": ([10, 0, 7], [0, 50, 35], 2, 16, 16, 16, 32, 16, torch.float32, 32, WHOLE),
    "bf16-varlen-H4": ([20, 0], [45, 66], 4, 32, 16, 32, 64, 16, torch.bfloat16, 32, WHOLE),
    # segments of 24 keys: cuts inside prefixes, inside new tokens and across sequences
    "varlen-prefix-H5-workspace24": ([0, 33, 5], [17, 40, 1], 5, 16, 8, 24, 40, 4, torch.float32, 16, 24),
    "long-prefix-H3-workspace40": ([150], [37], 3, 16, 8, 16, 32, 8, torch.float32, 16, 40),
    "empty-seq-H2-workspace7": ([10, 0, 7], [0, 50, 35], 2, 16, 16, 16, 32, 16, torch.float32, 32, 7),
    "bf16-varlen-H4-workspace64": ([20, 90], [45, 66], 4, 32, 16, 32, 64, 16, torch.bfloat16, 32, 64),
}
if ON_GPU:
    CASES["gpu-kimi-48b-8x512-bf16"] = ([0] * 4 + [700] * 4, [512] * 8, 32, 128, 64, 128, 512, 64, torch.bfloat16,
                                        64, WHOLE)
    CASES["gpu-kimi-48b-1x5000-bf16"] = ([3000], [5000], 8, 128, 64, 128, 512, 16, torch.bfloat16, 128, WHOLE)
    CASES["gpu-kimi-48b-1x4096-ctx70k-bf16-segments"] = ([70000], [4096], 32, 128, 64, 128, 512, 64,
                                                         torch.bfloat16, 128, 32768)


FP32_TOL = 3e-3 if ON_GPU else 1e-5  # the GPU's fp32 dots are TF32


def prefill_module():
    return kernel_module("mla_prefill", "_mla_prefill_kernel", shares_from=("jit_helpers",))


def make_prefill_batch(ctx_lens, lens, nh, nope, rope, v_dim, kv_lora, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = kv_lora + rope
    need = [-(-(c + n) // block_size) for c, n in zip(ctx_lens, lens)]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, width), float("nan"))
    at = 0
    for i, (c, n) in enumerate(zip(ctx_lens, lens)):
        blocks = perm[at:at + need[i]]
        at += need[i]
        tables[i, :need[i]] = torch.tensor(blocks, dtype=torch.int32)
        flat = cache[blocks].reshape(-1, width)
        flat[: c + n] = torch.randn(c + n, width, generator=g)
        cache[blocks] = flat.view(need[i], block_size, width)
    t = sum(lens)
    q = torch.randn(t, nh, nope + rope, generator=g)
    w_kv_b = torch.randn(nh * (nope + v_dim), kv_lora, generator=g) * kv_lora**-0.5
    cu = torch.tensor([0] + lens).cumsum(0)
    return (q[..., :nope].to(DEVICE, dtype), q[..., nope:].to(DEVICE, dtype), cache.to(DEVICE, dtype),
            w_kv_b.to(DEVICE, dtype), tables.to(DEVICE), torch.tensor(ctx_lens, device=DEVICE), cu.to(DEVICE))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_mla_prefill_matches_eager(case):
    mod = prefill_module()
    ctx_lens, lens, nh, nope, rope, v_dim, kv_lora, bs, dtype, block_m, workspace = CASES[case]
    args = make_prefill_batch(ctx_lens, lens, nh, nope, rope, v_dim, kv_lora, bs, dtype)
    scale = (nope + rope) ** -0.5
    out = mod.mla_prefill(*args, scale, block_m=block_m, block_n=16 if not ON_GPU else 64,
                          workspace_tokens=workspace)
    ref = eager.mla_attention(*args, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(f"mla_prefill {case}", out, ref, 2e-2 if dtype != torch.float32 else FP32_TOL)


@pytest.mark.parametrize("workspace", [1, 5, 16, 61])
def test_segmented_passes_agree_with_one_launch(workspace):
    """The running output and log-sum-exp folded over many segments equal the single launch over all keys."""
    mod = prefill_module()
    args = make_prefill_batch([9, 0, 23], [12, 20, 3], 2, 16, 8, 16, 32, 4, torch.float32, seed=3)
    one = mod.mla_prefill(*args, 0.3, block_m=16, block_n=16)
    assert_close(f"workspace {workspace}", mod.mla_prefill(*args, 0.3, block_m=16, block_n=16,
                                                           workspace_tokens=workspace), one, FP32_TOL)


def test_host_lengths_give_the_same_output_and_are_checked():
    """The caller's host copy of the lengths (no read-back) lays out the same launch, also over several segments and
    for the eager reference; host lengths that do not describe the batch are refused."""
    from shard_svc.ops.host_lengths import HostLengths
    from shard_svc.ops.triton.common import TritonKernelError

    mod = prefill_module()
    ctx_lens, lens = [9, 0, 23], [12, 20, 3]
    args = make_prefill_batch(ctx_lens, lens, 2, 16, 8, 16, 32, 4, torch.float32, seed=4)
    host = HostLengths([0, 12, 32, 35], ctx_lens)
    for workspace in (5, 64):
        kw = dict(block_m=16, block_n=16, workspace_tokens=workspace)
        assert torch.equal(mod.mla_prefill(*args, 0.3, lengths=host, **kw), mod.mla_prefill(*args, 0.3, **kw))
    assert torch.equal(eager.mla_attention(*args, 0.3, lengths=host), eager.mla_attention(*args, 0.3))
    with pytest.raises(TritonKernelError, match="host lengths of 2 contexts and 4 offsets for 3 sequences"):
        mod.mla_prefill(*args, 0.3, lengths=HostLengths([0, 12, 32, 35], ctx_lens[:2]))


def test_segments_cut_the_packed_keys_and_skip_sequences_without_queries():
    mod = prefill_module()
    # keys per sequence: 5 + 3, none (no new token), 0 + 40; workspace 16
    assert mod._segments([5, 7, 0], [3, 0, 40], 16) == [
        [(0, 0, 8), (2, 0, 8)], [(2, 8, 24)], [(2, 24, 40)]]
    assert mod._segments([5, 0], [3, 40], 1 << 20) == [[(0, 0, 8), (1, 0, 40)]]


def test_layout_longest_blocks_first_and_blocks_before_a_piece_left_out():
    mod = prefill_module()
    # one segment with every key: (first query row, queries left, first position, workspace row, k_lo, k_hi)
    blocks, starts = mod._layout([(0, 0, 8), (1, 0, 37)], [5, 0], [0, 3, 40], 16)
    rows = [tuple(blocks[i:i + 6]) for i in range(0, len(blocks), 6)]
    assert starts == [0, 8]
    assert rows == [(35, 5, 32, 8, 0, 37), (19, 21, 16, 8, 0, 37), (3, 37, 0, 8, 0, 37), (0, 3, 5, 0, 0, 8)]
    # a piece of sequence 1's keys 20 .. 30: the block of positions 0 .. 15 sees none of it
    blocks, starts = mod._layout([(1, 20, 30)], [5, 0], [0, 3, 40], 16)
    rows = [tuple(blocks[i:i + 6]) for i in range(0, len(blocks), 6)]
    assert starts == [0] and rows == [(19, 21, 16, 0, 20, 30), (35, 5, 32, 0, 20, 30)]


def test_a_segment_pipelines_three_key_tiles_once_a_sequence_has_enough_keys_in_it():
    mod = prefill_module()
    deep = mod.DEEP_PIPELINE_KEYS
    assert mod.pipeline_stages([(0, 0, deep - 1), (1, 0, 8)]) == 2
    assert mod.pipeline_stages([(0, 0, 8), (1, 100, 100 + deep)]) == 3


@pytest.mark.parametrize("stages", [2, 3])
def test_either_pipeline_depth_gives_the_same_output(stages):
    """The depth only changes how far ahead key tiles load: the launch's result is the default one's."""
    mod = prefill_module()
    args = make_prefill_batch([9, 0, 23], [12, 20, 3], 2, 16, 8, 16, 32, 4, torch.float32, seed=5)
    kw = dict(block_m=16, block_n=16)
    assert torch.equal(mod.mla_prefill(*args, 0.3, num_stages=stages, **kw), mod.mla_prefill(*args, 0.3, **kw))


def test_op_seam_serves_triton_mla_prefill():
    from shard_svc.ops import select_ops

    from shard_svc.engine.memory_profile import attention_peak_context

    mod = prefill_module()
    ops = select_ops(DEVICE, "triton")
    assert dict(ops.backends)["mla_prefill"] == ("triton; cudnn for long sequences" if ON_GPU else "triton")
    assert not getattr(ops.mla_prefill, "graph_safe", False)  # reads the lengths on the host
    # the memory probe profiles a pass reading the whole workspace; on the GPU, one that cuDNN takes
    assert mod.CONTEXT_WORKSPACE_TOKENS == 32768 and mod.LONG_PAIRS == 1 << 30
    assert attention_peak_context(ops, 8192) == (131072 if ON_GPU else 32768)
