"""Triton chunked KDA prefill against the token-loop reference (float64) and the eager chunked op.

Varlen batches with boundaries off the 64-row chunk grid, odd and empty sequences, head counts that are not powers
of two, both gate forms, extreme decays, and a NaN-poisoned state pool whose unused slots must stay untouched.
"""

from __future__ import annotations

import pytest
import torch

from shard_svc.ops.kda import eager
from shard_svc.ops.kda.naive import naive_kda_varlen
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, assert_unused_untouched, cu_seqlens, poisoned_pool

# (lens, H, K, V, lower_bound, dtype, flavour)
CASES = {
    "one-130-H2-K32-V16-softplus": ([130], 2, 32, 16, None, torch.float32, "plain"),
    "varlen-70,5,64-H3-K16-V32-softplus": ([70, 5, 64], 3, 16, 32, None, torch.float32, "plain"),
    "varlen-1,2,63,65-H3-K16-lower-bound": ([1, 2, 63, 65], 3, 16, 16, -5.0, torch.float32, "plain"),
    "varlen-3,0,67-H1-K8-V8-tiny-head": ([3, 0, 67], 1, 8, 8, None, torch.float32, "plain"),
    "varlen-65,63-H2-K32-bf16": ([65, 63], 2, 32, 32, None, torch.bfloat16, "plain"),
    "one-128-H2-huge-decay": ([128], 2, 16, 16, None, torch.float32, "huge_decay"),
    "one-96-H2-identical-keys": ([96], 2, 16, 16, None, torch.float32, "same_keys"),
    "one-128-H2-lower-bound-saturated": ([128], 2, 16, 16, -5.0, torch.float32, "lb_saturated"),
    "one-80-H2-K64-split-span": ([80], 2, 64, 16, None, torch.float32, "split_span"),
}
GPU_CASES = {
    "gpu-varlen-1000,3000,96-H32-K128-bf16": ([1000, 3000, 96], 32, 128, 128, None, torch.bfloat16, "plain"),
    "gpu-varlen-777,2048-H32-K128-bf16-lower-bound": ([777, 2048], 32, 128, 128, -5.0, torch.bfloat16, "plain"),
    "gpu-one-4096-H6-K128-fp32": ([4096], 6, 128, 128, None, torch.float32, "plain"),
}


def make_inputs(lens, heads, dk, dv, dtype, flavour, num_slots=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    q, k, v = rnd(t, heads, dk), rnd(t, heads, dk), rnd(t, heads, dv)
    f, beta_logits = rnd(t, heads, dk), rnd(t, heads)
    a_log = torch.log(torch.rand(heads, generator=g) * 15 + 1).to(DEVICE)
    dt_bias = rnd(heads * dk, scale=0.1)
    if flavour == "huge_decay":  # per-step decays down to e^-500: any split through exp(-G) would overflow
        f, a_log, beta_logits = f * 3, torch.full_like(a_log, 4.0), beta_logits * 3
    elif flavour == "same_keys":  # (I + A) with all-ones lower triangle: a badly conditioned Neumann series
        k = k[:1].expand_as(k).contiguous()
        f, a_log = torch.full_like(f, -30.0), torch.full_like(a_log, -8.0)
        beta_logits = torch.full_like(beta_logits, 8.0)
    elif flavour == "split_span":  # channels 0-31 barely decay, 32-63 by ~e^-70 a step: one slice each side of
        # the 16-row chunks' one-reference bound (REF_SPAN_LOG2)
        f = torch.cat([f[..., :32] - 10.0, f[..., 32:] + 10.0], -1)
        a_log = torch.full_like(a_log, 2.0)
    elif flavour == "lb_saturated":  # every step at the lower bound: a chunk decays by e^-320
        f = torch.full_like(f, 30.0)
    slots = torch.randperm(num_slots, generator=g)[: len(lens)].to(DEVICE)
    return [x.to(dtype) for x in (q, k, v, f, beta_logits)] + [a_log, dt_bias], slots


def run_case(lens, heads, dk, dv, lb, dtype, flavour, tol, **config):
    from shard_svc.ops.triton.kda_chunk import kda_prefill

    (q, k, v, f, bl, a_log, dt_bias), slots = make_inputs(lens, heads, dk, dv, dtype, flavour)
    cu = cu_seqlens(lens)
    pool = poisoned_pool((7, heads, dk, dv), slots)
    ours_pool = pool.clone()
    o = kda_prefill(q, k, v, f, bl, a_log, dt_bias, lb, ours_pool, slots, cu, **config)
    assert o.dtype == v.dtype and o.shape == v.shape
    assert_unused_untouched("kda_prefill state", ours_pool, slots)

    # float64 token loop on the same (rounded) inputs: the independent reference
    ref_pool = pool.double()
    ref = naive_kda_varlen(*(x.double() for x in (q, k, v, f, bl, a_log, dt_bias)), lb, ref_pool, slots, cu)
    assert_close("o vs token loop", o, ref, tol)
    assert_close("state vs token loop", ours_pool[slots], ref_pool[slots], tol)

    # the eager chunked op at the inputs' own precision
    eager_pool = pool.clone()
    ref_e = eager.kda_prefill(q, k, v, f, bl, a_log, dt_bias, lb, eager_pool, slots, cu)
    assert_close("o vs eager", o, ref_e, tol)
    assert_close("state vs eager", ours_pool[slots], eager_pool[slots], tol)


def _tol(dtype):
    if dtype != torch.float32:
        return 2e-2  # bf16 inputs, bf16 intermediates (as fla)
    return 5e-3 if ON_GPU else 1e-4  # the GPU's fp32 dots are tf32


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kda_prefill_matches_reference(case):
    lens, heads, dk, dv, lb, dtype, flavour = CASES[case]
    run_case(lens, heads, dk, dv, lb, dtype, flavour, _tol(dtype))


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("case", ["varlen-1,2,63,65-H3-K16-lower-bound", "one-128-H2-huge-decay",
                                  "one-96-H2-identical-keys", "varlen-65,63-H2-K32-bf16",
                                  "one-128-H2-lower-bound-saturated", "one-80-H2-K64-split-span"])
def test_kda_prefill_each_chunk_matches_reference(case, chunk):
    """Every chunk size (16, the default, 32 and 64), both gates: the same results,
    boundaries on and off each grid. K3's bounded gate takes the one-reference block products (REF_SPAN_LOG2),
    saturated at the bound: factors up to 2^58."""
    lens, heads, dk, dv, lb, dtype, flavour = CASES[case]
    run_case(lens, heads, dk, dv, lb, dtype, flavour, _tol(dtype), chunk=chunk)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("case", ["varlen-1,2,63,65-H3-K16-lower-bound", "varlen-65,63-H2-K32-bf16"])
def test_kda_prefill_levels_only_match_reference(case, chunk):
    """`block_ref=False`: the pairs inside every 16-row block by levels alone (what a slice whose gate spans too far
    takes), on inputs where the one-reference products would otherwise serve."""
    lens, heads, dk, dv, lb, dtype, flavour = CASES[case]
    run_case(lens, heads, dk, dv, lb, dtype, flavour, _tol(dtype), chunk=chunk, block_ref=False)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("intra_slice", [64, 16])
@pytest.mark.parametrize("case", ["one-80-H2-K64-split-span", "varlen-1,2,63,65-H3-K16-lower-bound"])
def test_kda_prefill_intra_slices_match_reference(case, intra_slice, chunk):
    """The intra kernel's channel slices at K = V = 64: one holding every channel (the split-span gate then fails
    the one-reference check for the whole slice) or four, each written out before the next is read."""
    lens, heads, _, _, lb, dtype, flavour = CASES[case]
    run_case(lens, heads, 64, 64, lb, dtype, flavour, _tol(dtype), chunk=chunk, intra_slice=intra_slice)


@pytest.mark.parametrize("dv,block_v", [(64, 16), (64, 32), (48, 32)])
@pytest.mark.parametrize("case", ["varlen-65,63-H2-K32-bf16", "varlen-1,2,63,65-H3-K16-lower-bound"])
def test_kda_prefill_walk_blocks_match_reference(case, dv, block_v):
    """The walk cut into V-blocks (more programs, each carrying its own columns of the state), the last one partly
    past V when the block does not divide it."""
    lens, heads, dk, _, lb, dtype, flavour = CASES[case]
    run_case(lens, heads, dk, dv, lb, dtype, flavour, _tol(dtype), block_v=block_v)


@pytest.mark.parametrize("pieces", [2, 3, 8])
@pytest.mark.parametrize("case,chunk", [("one-130-H2-K32-V16-softplus", 64), ("one-128-H2-lower-bound-saturated", 16),
                                        ("one-80-H2-K64-split-span", 16), ("varlen-1,2,63,65-H3-K16-lower-bound", 16),
                                        ("varlen-65,63-H2-K32-bf16", 16), ("varlen-65,63-H2-K32-bf16", 32)])
def test_kda_prefill_in_pieces_is_the_one_piece_result(case, chunk, pieces):
    """The pass cut into pipelined token ranges, each sequence's part moved to its own chunk grid (packed sequences
    start off the grid of the edges): each range's walk continues from the state the previous one left in the slot,
    so output and final state equal the one-piece call's bit for bit (and the token loop's)."""
    from shard_svc.ops.triton.kda_chunk import kda_prefill

    lens, heads, dk, dv, lb, dtype, flavour = CASES[case]
    run_case(lens, heads, dk, dv, lb, dtype, flavour, _tol(dtype), chunk=chunk, pieces=pieces)
    (q, k, v, f, bl, a_log, dt_bias), slots = make_inputs(lens, heads, dk, dv, dtype, flavour)
    pool = poisoned_pool((7, heads, dk, dv), slots)
    pools = [pool.clone() for _ in range(2)]
    outs = [kda_prefill(q, k, v, f, bl, a_log, dt_bias, lb, pool, slots, cu_seqlens(lens), chunk=chunk, pieces=n)
            for pool, n in zip(pools, (1, pieces))]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(pools[0][slots], pools[1][slots])


def test_kda_prefill_cuts_a_lone_long_sequence_by_default(monkeypatch):
    """By default a lone sequence runs in T // PIECE_TOKENS pipelined ranges (at most MAX_PIECES), packed ones and
    short ones in one launch of each kernel; the result is the one-range call's either way."""
    from shard_svc.ops.triton import kda_chunk

    pipelined = []
    run_pipelined = kda_chunk._run_pipelined

    def recording_run_pipelined(launches, device):
        pipelined.append(len(launches))
        run_pipelined(launches, device)

    monkeypatch.setattr(kda_chunk, "_run_pipelined", recording_run_pipelined)
    monkeypatch.setattr(kda_chunk, "PIECE_TOKENS", 32)
    monkeypatch.setattr(kda_chunk, "MAX_PIECES", 3)
    for lens, expected in (([130], [3]), ([64], [2]), ([31], []), ([70, 5, 64], [])):
        pipelined.clear()
        (q, k, v, f, bl, a_log, dt_bias), slots = make_inputs(lens, 2, 16, 16, torch.float32, "plain")
        pool = poisoned_pool((7, 2, 16, 16), slots)
        pools = [pool.clone() for _ in range(2)]
        outs = [kda_chunk.kda_prefill(q, k, v, f, bl, a_log, dt_bias, None, p, slots, cu_seqlens(lens), pieces=n)
                for p, n in zip(pools, (None, 1))]
        assert pipelined == expected, lens
        assert torch.equal(outs[0], outs[1]) and torch.equal(pools[0][slots], pools[1][slots]), lens


def test_kda_prefill_refuses_other_chunks_and_no_pieces():
    from shard_svc.ops.triton.common import TritonKernelError
    from shard_svc.ops.triton.kda_chunk import kda_prefill

    (q, k, v, f, bl, a_log, dt_bias), slots = make_inputs([5], 1, 8, 8, torch.float32, "plain")
    with pytest.raises(TritonKernelError, match="chunk 48 is not one of"):
        kda_prefill(q, k, v, f, bl, a_log, dt_bias, None, poisoned_pool((7, 1, 8, 8), slots), slots,
                    cu_seqlens([5]), chunk=48)
    with pytest.raises(TritonKernelError, match="pieces 0 must be at least 1"):
        kda_prefill(q, k, v, f, bl, a_log, dt_bias, None, poisoned_pool((7, 1, 8, 8), slots), slots,
                    cu_seqlens([5]), pieces=0)


@pytest.mark.skipif(not ON_GPU, reason="real Kimi-Linear shapes run on the GPU only (the interpreter is too slow)")
@pytest.mark.parametrize("case", list(GPU_CASES), ids=list(GPU_CASES))
def test_kda_prefill_real_shapes(case):
    lens, heads, dk, dv, lb, dtype, flavour = GPU_CASES[case]
    run_case(lens, heads, dk, dv, lb, dtype, flavour, _tol(dtype))


def test_kda_prefill_continues_from_state():
    """Two prefill calls (split off the chunk grid) give the same output and state as one call."""
    from shard_svc.ops.triton.kda_chunk import kda_prefill

    (q, k, v, f, bl, a_log, dt_bias), slots = make_inputs([100], 2, 16, 16, torch.float32, "plain")
    pool = poisoned_pool((7, 2, 16, 16), slots)
    whole_pool, split_pool = pool.clone(), pool.clone()
    whole = kda_prefill(q, k, v, f, bl, a_log, dt_bias, None, whole_pool, slots, cu_seqlens([100]))
    parts = [kda_prefill(*(x[a:b] for x in (q, k, v, f, bl)), a_log, dt_bias, None, split_pool, slots,
                         cu_seqlens([b - a])) for a, b in ((0, 37), (37, 100))]
    assert_close("o split vs whole", torch.cat(parts), whole, _tol(torch.float32))
    assert_close("state split vs whole", split_pool[slots], whole_pool[slots], _tol(torch.float32))


def test_kda_prefill_rejects_fp64_state():
    from shard_svc.ops.triton.common import TritonKernelError
    from shard_svc.ops.triton.kda_chunk import kda_prefill

    (q, k, v, f, bl, a_log, dt_bias), slots = make_inputs([10], 1, 16, 16, torch.float32, "plain")
    pool = torch.zeros(7, 1, 16, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TritonKernelError, match="state_pool"):
        kda_prefill(q, k, v, f, bl, a_log, dt_bias, None, pool, slots, cu_seqlens([10]))


# (lens, dtype, points as (sequence, tokens before the point)): on and off the chunk grid, one token in, one short of
# the end, two in one sequence, none in another
SNAPSHOT_CASES = {
    "varlen-70,5,130-fp32": ([70, 5, 130], torch.float32, [(0, 33), (2, 1), (2, 64), (2, 129)]),
    "varlen-65,63-bf16": ([65, 63], torch.bfloat16, [(0, 64), (1, 17)]),
}


@pytest.mark.parametrize("lb", [None, -5.0], ids=["softplus", "lower-bound"])
@pytest.mark.parametrize("case", list(SNAPSHOT_CASES), ids=list(SNAPSHOT_CASES))
@pytest.mark.parametrize("op", ["triton", "eager"])
def test_kda_prefill_writes_the_state_at_each_snapshot_point(case, op, lb):
    """The state after the first m tokens of a sequence lands in the point's slot, as the token loop run over those
    m tokens alone leaves it; the outputs and final states are the pass's without points; no other slot is written.
    Both gates, so both default chunk sizes (64 and K3's 16)."""
    from shard_svc.ops.kda.snapshots import StateSnapshots
    from shard_svc.ops.triton.kda_chunk import kda_prefill as triton_prefill

    prefill = triton_prefill if op == "triton" else eager.kda_prefill
    lens, dtype, at = SNAPSHOT_CASES[case]
    heads, dk, dv = 2, 16, 32
    (q, k, v, f, bl, a_log, dt_bias), slots = make_inputs(lens, heads, dk, dv, dtype, "plain", num_slots=9)
    free = [s for s in range(9) if s not in slots.tolist()]
    points = [(b, m, free[i]) for i, (b, m) in enumerate(at)]
    cu = cu_seqlens(lens)
    snapshots = StateSnapshots.build(cu.tolist(), slots.tolist(), points, q.device)
    pool = poisoned_pool((9, heads, dk, dv), slots)
    plain_pool, snap_pool = pool.clone(), pool.clone()
    want = prefill(q, k, v, f, bl, a_log, dt_bias, lb, plain_pool, slots, cu)
    got = prefill(q, k, v, f, bl, a_log, dt_bias, lb, snap_pool, slots, cu, snapshots=snapshots)
    tol = _tol(dtype)
    assert_close("o with points vs without", got, want, tol)
    assert_close("final states with points vs without", snap_pool[slots], plain_pool[slots], tol)
    written = torch.cat([slots, torch.tensor([s for _, _, s in points], device=slots.device)])
    assert_unused_untouched("kda_prefill state with snapshots", snap_pool, written)
    for b, m, target in points:
        start = int(cu[b])
        ref_pool = pool.double()
        one = slots[b:b + 1]
        naive_kda_varlen(*(x[start:start + m].double() for x in (q, k, v, f, bl)), a_log.double(), dt_bias.double(),
                         lb, ref_pool, one, cu_seqlens([m]))
        assert_close(f"state at point {m} of sequence {b}", snap_pool[target], ref_pool[int(one)], tol)


def test_snapshot_points_must_lie_inside_their_sequence():
    from shard_svc.ops.kda.snapshots import StateSnapshots

    for points in ([(0, 0, 5)], [(0, 10, 5)], [(1, 3, 5), (1, 2, 6)]):
        with pytest.raises(ValueError, match="snapshot point"):
            StateSnapshots.build([0, 10, 20], [0, 1], points, torch.device("cpu"))
