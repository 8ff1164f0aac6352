"""The eager MLA op processes long prompts in query blocks; blocking must not change the result."""

import pytest
import torch

import shard_svc.ops.mla.eager as mla


@pytest.mark.parametrize("block", [1, 7, 64])
def test_query_blocks_equal_one_block(monkeypatch, block):
    gen = torch.Generator().manual_seed(0)
    t, nh, nope, rope, kv_lora, v = 150, 3, 8, 4, 16, 8
    q_nope = torch.randn(t, nh, nope, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(t, nh, rope, generator=gen, dtype=torch.float64)
    cache = torch.randn(20, 16, kv_lora + rope, generator=gen, dtype=torch.float64)
    w_kv_b = torch.randn(nh * (nope + v), kv_lora, generator=gen, dtype=torch.float64)
    args = (q_nope, q_pe, cache, w_kv_b, torch.arange(20).view(1, 20).int(), torch.tensor([9]),
            torch.tensor([0, t]), 0.2)
    monkeypatch.setattr(mla, "QUERY_BLOCK", 10_000)
    whole = mla.mla_attention(*args)
    monkeypatch.setattr(mla, "QUERY_BLOCK", block)
    torch.testing.assert_close(mla.mla_attention(*args), whole, rtol=1e-12, atol=1e-12)
