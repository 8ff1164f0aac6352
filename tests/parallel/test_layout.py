"""Pure layout arithmetic and the slicing record, on the meta device (no process group)."""

import pytest
import torch

from shard_svc.config import ModelConfig
from shard_svc.make_tiny import kimi_k3_config, kimi_linear_config
from shard_svc.model import KimiForCausalLM
from shard_svc.parallel.errors import ParallelConfigError
from shard_svc.parallel.layout import ParallelLayout, near_even_split
from shard_svc.parallel.plan import ShardPlan
from shard_svc.state.pools import KDAStatePool
from tests.engine.conftest import linear_config


@pytest.mark.parametrize("tp,ep,world,groups,moe_tp", [
    (2, 1, 2, [[0, 1]], 2), (1, 2, 2, [[0], [1]], 1), (2, 2, 2, [[0, 1]], 1), (2, 4, 4, [[0, 1], [2, 3]], 1),
    (4, 2, 4, [[0, 1, 2, 3]], 2), (4, 4, 4, [[0, 1, 2, 3]], 1)], ids=lambda v: str(v))
def test_group_shape(tp, ep, world, groups, moe_tp):
    layout = ParallelLayout(tp, ep)
    assert layout.world == world and layout.attention_groups() == groups and layout.moe_tp == moe_tp


def test_every_expert_and_width_slice_is_held_exactly_once():
    for tp, ep in [(2, 1), (1, 2), (4, 2), (2, 4), (3, 3)]:
        held = {}
        for rank in range(max(tp, ep)):
            lay = ParallelLayout(tp, ep, rank)
            first, count = lay.experts(7)
            start, size = lay.expert_width(48)
            for e in range(first, first + count):
                for i in range(start, start + size):
                    held[(e, i)] = held.get((e, i), 0) + 1
        assert held == {(e, i): 1 for e in range(7) for i in range(48)}, (tp, ep)


def test_near_even_split():
    assert [near_even_split(6, 4, i) for i in range(4)] == [(0, 2), (2, 2), (4, 1), (5, 1)]


@pytest.mark.parametrize("tp,ep,message", [
    (0, 1, "at least 1"), (2, 3, "multiple of the smaller"), (4, 1, "KDA heads = 2 is not divisible by tp = 4"),
    (1, 8, "num_experts = 6 is fewer than ep = 8")])
def test_layouts_that_cannot_split_the_model_name_the_sizes(tp, ep, message):
    with pytest.raises(ParallelConfigError, match=message):
        ParallelLayout(tp, ep).check(ModelConfig.from_dict(linear_config()))


def test_slices_on_meta_record_full_and_local_shapes():
    """Slicing a meta model records, per parameter, the full shape and the slice the loader must read."""
    from shard_svc.parallel.expert_parallel import shard_experts
    from shard_svc.parallel.tensor_parallel import shard_kda, shard_mla

    cfg = ModelConfig.from_dict(kimi_k3_config(8))
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, torch.bfloat16)
    lay, plan = ParallelLayout(2, 2, rank=1), ShardPlan()

    class Comm:  # only the layout is read while slicing
        layout = lay

    shard_kda(model.model.layers[0].self_attn, "model.layers.0.self_attn", lay, plan)
    shard_mla(model.model.layers[3].self_attn, "model.layers.3.self_attn", lay, plan)
    shard_experts(model, Comm(), plan)
    kda, mla = model.model.layers[0].self_attn, model.model.layers[3].self_attn
    assert kda.num_heads == 2 and tuple(kda.q_proj.weight.shape) == (32, 48) and kda.q_conv1d.groups == 32
    assert plan.params["model.layers.0.self_attn.o_proj.weight"].slices == ((1, 32, 32),)
    assert plan.params["model.layers.0.self_attn.A_log"].slices == ((0, 2, 2),)
    assert mla.nh == 2 and tuple(mla.kv_b_proj.weight.shape) == (64, 32) and tuple(mla.o_proj.weight.shape) == (48, 32)
    w2 = plan.params["model.layers.1.block_sparse_moe.experts.w2"]
    assert w2.full_shape == (8, 64, 32) and w2.local_shape() == (4, 64, 32)
    assert [w2.local_expert(e) for e in (3, 4, 7)] == [None, 0, 3]


def test_kda_pool_holds_this_ranks_heads_only():
    cfg = ModelConfig.from_dict(kimi_linear_config(4))
    pool = KDAStatePool(cfg, 3, torch.device("meta"), torch.float32, num_heads=2)
    assert pool.recurrent.shape == (3, 3, 2, 16, 16) and pool.conv.shape == (3, 3, 3 * 2 * 16, 3)
    with pytest.raises(ValueError, match="must divide the model's 4 KDA heads"):
        KDAStatePool(cfg, 3, torch.device("meta"), torch.float32, num_heads=3)
