"""Batch-invariant mode inside a tiny model (shard_svc/ops/batch_invariant.py): a prompt prefilled as a context pass
then a short tail gives, op call by op call, the bits one pass over it gives (bench/split_divergence.py's trace), in
bf16. The Triton backend as served does not (under the interpreter, 64 + 3 tokens: the fused shared-expert op of
small passes rounds the tail differently); on the eager backend the mode is refused by name. A served engine runs
decode-only passes on the fast ops."""

from __future__ import annotations

import pytest
import torch

from bench.split_divergence import divergence
from shard_svc.engine.assemble import EngineOptions, assemble_alone
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.ops import OpBackendError, select_ops
from shard_svc.ops.batch_invariant import EXPERT_BLOCK_M, batch_invariant
from tests.engine.conftest import linear_config, random_model
from tests.kernels.conftest import DEVICE
from tests.kernels.test_invariant_linear import module as invariant_module
from tests.kernels.test_linear import linear_module
from tests.kernels.test_mla_decode import mla_module
from tests.kernels.test_moe_experts import moe_module


def _engine(ops) -> Engine:
    cfg, model = random_model(linear_config(), seed=0, dtype=torch.bfloat16)
    return Engine(cfg, model.to(DEVICE), ops, DEVICE, EngineConfig(num_state_slots=4, num_kv_blocks=96,
                                                                   kv_block_size=4, prefill_token_budget=1000))


def test_the_eager_backend_is_refused_by_name():
    with pytest.raises(OpBackendError, match="--batch-invariant needs the Triton op backend"):
        batch_invariant(select_ops(torch.device("cpu"), "eager"))


@pytest.mark.slow
def test_a_split_prefill_gives_one_passs_bits_op_by_op():
    moe_module(), mla_module(), linear_module(), invariant_module()
    ops = batch_invariant(select_ops(DEVICE, "triton"))
    assert ops.moe_experts_shared is None and dict(ops.backends)["moe_experts"].endswith(f"M-block {EXPERT_BLOCK_M}")
    row = divergence(_engine(ops), 64, 3)  # on the KDA chunk grid, as the prefix cache cuts
    assert row["cause"] == "none", row


def test_a_served_engine_keeps_the_fast_ops_for_decode_only_passes(tiny_linear):
    moe_module(), mla_module(), linear_module(), invariant_module()
    opts = EngineOptions(tiny_linear, str(DEVICE), op_backend="triton", batch_invariant=True, enforce_eager=True,
                         config=EngineConfig(num_state_slots=2, num_kv_blocks=16, kv_block_size=16))
    runner = assemble_alone(opts, DEVICE).runner
    assert dict(runner.ops.backends)["linear"] == "triton, batch-invariant"
    assert runner.decode_ops.linear is select_ops(DEVICE, "triton").linear
