"""Triton KDA decode step against the float64 token loop and the eager decode op, with a NaN-poisoned pool."""

from __future__ import annotations

import pytest
import torch

from shard_svc.ops.kda import eager
from shard_svc.ops.kda.naive import naive_kda_varlen
from tests.kernels.conftest import DEVICE, ON_GPU, assert_close, assert_unused_untouched, cu_seqlens, poisoned_pool
from tests.kernels.test_kda_chunk import make_inputs

# (N sequences, H, K, V, lower_bound, dtype)
CASES = {
    "N1-H3-K16-V32-softplus": (1, 3, 16, 32, None, torch.float32),
    "N5-H3-K32-V16-lower-bound": (5, 3, 32, 16, -5.0, torch.float32),
    "N4-H2-K8-V8-tiny-head": (4, 2, 8, 8, None, torch.float32),
    "N3-H5-K24-V40-odd-dims": (3, 5, 24, 40, None, torch.float32),
    "N6-H2-K32-V32-bf16": (6, 2, 32, 32, -5.0, torch.bfloat16),
}
if ON_GPU:
    CASES.update({f"gpu-N{n}-H32-K128-bf16": (n, 32, 128, 128, None, torch.bfloat16) for n in (1, 64, 300)})


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_kda_decode_matches_reference(case):
    from shard_svc.ops.triton.kda_decode import kda_decode

    n, heads, dk, dv, lb, dtype = CASES[case]
    num_slots = n + 3
    (q, k, v, f, bl, a_log, dt_bias), slots = make_inputs([1] * n, heads, dk, dv, dtype, "plain", num_slots)
    cu = cu_seqlens([1] * n)
    pool = poisoned_pool((num_slots, heads, dk, dv), slots)
    ours = pool.clone()
    o = kda_decode(q, k, v, f, bl, a_log, dt_bias, lb, ours, slots, cu)
    assert o.dtype == v.dtype and o.shape == v.shape
    assert_unused_untouched("kda_decode state", ours, slots)
    tol = 1e-2 if dtype != torch.float32 else 1e-5

    ref_pool = pool.double()
    ref = naive_kda_varlen(*(x.double() for x in (q, k, v, f, bl, a_log, dt_bias)), lb, ref_pool, slots, cu)
    assert_close("o vs token loop", o, ref, tol)
    assert_close("state vs token loop", ours[slots], ref_pool[slots], tol)
    eager_pool = pool.clone()
    ref_e = eager.kda_decode(q, k, v, f, bl, a_log, dt_bias, lb, eager_pool, slots, cu)
    assert_close("o vs eager", o, ref_e, tol)
    assert_close("state vs eager", ours[slots], eager_pool[slots], tol)


def test_kda_decode_accepts_strided_qkv():
    """q, k, v as views into one [N, 3HK] projection output (how the model calls it)."""
    from shard_svc.ops.triton.kda_decode import kda_decode

    n, heads, dk = 3, 2, 16
    (_, _, _, f, bl, a_log, dt_bias), slots = make_inputs([1] * n, heads, dk, dk, torch.float32, "plain")
    qkv = torch.randn(n, 3 * heads * dk, device=DEVICE)
    q, k, v = (p.view(n, heads, dk) for p in qkv.split(heads * dk, dim=-1))
    pool = poisoned_pool((7, heads, dk, dk), slots)
    ours, ref_pool = pool.clone(), pool.clone()
    o = kda_decode(q, k, v, f, bl, a_log, dt_bias, None, ours, slots, cu_seqlens([1] * n))
    ref = eager.kda_decode(q, k, v, f, bl, a_log, dt_bias, None, ref_pool, slots, cu_seqlens([1] * n))
    assert_close("o", o, ref, 1e-5)
    assert_close("state", ours[slots], ref_pool[slots], 1e-5)
