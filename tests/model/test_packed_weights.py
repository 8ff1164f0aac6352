"""Packed weights (`packed_groups` of KDA, MLA and the gated MLP, packed by `pack_weights` in the model runner): the
checkpoint-named parameters of each group become views of one buffer, nothing is held twice, each group of linears
runs as one `ops.linear` product over that buffer, and a tiny checkpoint generates the same tokens and bitwise the
same logits as with unpacked weights (the streamed layers' path: each group's weights concatenated per step)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shard_svc.checkpoint.loader import load_model
from shard_svc.config import ModelConfig
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.model import KimiForCausalLM
from shard_svc.model.kimi import pack_weights
from shard_svc.model.layers import Linear, PackedWeights, packed_rows
from shard_svc.ops import select_ops
from shard_svc.parallel.expert_parallel import shard_experts
from shard_svc.parallel.layout import ParallelLayout
from shard_svc.parallel.plan import ShardPlan, narrow_all
from shard_svc.parallel.tensor_parallel import shard_attention, shard_dense
from tests.engine.conftest import k3_config, linear_config, random_model

CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(10, 60)), [42] * 9]

# (qualified name of a group's first module, member names) per family: both KDA output gate forms (low-rank g_a in
# Kimi-Linear, full-rank g_proj in K3), MLA without q-LoRA (q_proj) and with it plus the output gate (K3).
GROUPS = {
    "tiny_linear": {
        "model.layers.0.self_attn.q_proj": ("q_proj", "k_proj", "v_proj"),
        "model.layers.0.self_attn.q_conv1d": ("q_conv1d", "k_conv1d", "v_conv1d"),
        "model.layers.0.self_attn.f_a_proj": ("f_a_proj", "g_a_proj", "b_proj"),
        "model.layers.0.mlp.gate_proj": ("gate_proj", "up_proj"),
        "model.layers.1.block_sparse_moe.shared_experts.gate_proj": ("gate_proj", "up_proj"),
        "model.layers.3.self_attn.q_proj": ("q_proj", "kv_a_proj_with_mqa"),
    },
    "tiny_k3_small": {
        "model.layers.0.self_attn.f_a_proj": ("f_a_proj", "g_proj", "b_proj"),
        "model.layers.3.self_attn.q_a_proj": ("q_a_proj", "kv_a_proj_with_mqa", "g_proj"),
    },
}


def groups(model) -> list[tuple[nn.Module, ...]]:
    return [g for m in model.modules() if isinstance(m, PackedWeights) for g in m.packed_groups()]


def linear_groups(model) -> list[tuple[Linear, ...]]:
    return [g for g in groups(model) if isinstance(g[0], Linear)]


def is_packed(group) -> bool:
    return packed_rows([m.weight for m in group]) is not None


def unpack(model) -> None:
    """Each weight of every group in its own storage again: the per-step concatenation path."""
    for group in groups(model):
        for module in group:
            module.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=False)


def recording_ops(calls: list[tuple[int, tuple[int, ...]]]):
    """Eager ops whose `linear` records (storage address, shape) of each weight it multiplies by."""
    def linear(x, w):
        calls.append((w.data_ptr(), tuple(w.shape)))
        return F.linear(x, w)

    return dataclasses.replace(select_ops(CPU, "eager"), linear=linear)


def generate(cfg, model, packed: bool, calls: list | None = None):
    ops = select_ops(CPU, "eager") if calls is None else recording_ops(calls)
    engine = Engine(cfg, model, ops, CPU, EngineConfig(num_state_slots=3, num_kv_blocks=64))
    if not packed:
        unpack(model)
    assert all(is_packed(g) == packed for g in groups(model))
    seqs = [engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6,
                                                          ignore_eos=True), keep_prompt_logits=True)
            for i, p in enumerate(PROMPTS)]
    while engine.has_work():
        engine.step()
    return seqs


@pytest.mark.parametrize("family", ["tiny_linear", "tiny_k3_small"])
def test_packed_weights_keep_names_values_and_outputs(family, request):
    cfg, model = load_model(request.getfixturevalue(family), dtype="float32")
    names = {m: n for n, m in model.named_modules()}
    found = {names[g[0]]: tuple(names[m].rpartition(".")[2] for m in g) for g in groups(model)}
    assert found.items() >= GROUPS[family].items()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    packed = generate(cfg, model, packed=True)
    # names and values unchanged; each group shares one storage and no bytes are held twice
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[n], before[n]) for n in before)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == sum(p.nbytes for p in model.parameters())
    for group in groups(model):
        assert len({m.weight.untyped_storage().data_ptr() for m in group}) == 1

    cfg, model = load_model(request.getfixturevalue(family), dtype="float32")
    unpacked = generate(cfg, model, packed=False)
    for a, b in zip(packed, unpacked, strict=True):
        assert a.output == b.output
        assert torch.equal(torch.cat(a.prompt_logits), torch.cat(b.prompt_logits))
        assert torch.equal(torch.cat(a.step_logits), torch.cat(b.step_logits))


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("family", ["tiny_linear", "tiny_k3_small"])
def test_each_group_runs_one_product(family, packed, request):
    """Every pass runs one product per group of linears and none per member: over the packed buffer itself (no
    copy), or, unpacked, over the weights concatenated for the call. So a pass makes sum(len(group) - 1) fewer
    linear calls than the model has linears (but kv_b_proj, whose weight the attention op reads)."""
    cfg, model = load_model(request.getfixturevalue(family), dtype="float32")
    calls: list[tuple[int, tuple[int, ...]]] = []
    generate(cfg, model, packed, calls)
    count = Counter(calls)
    passes = count[(model.lm_head.weight.data_ptr(), tuple(model.lm_head.weight.shape))]  # once per pass
    assert passes > 0
    saved = 0
    for group in linear_groups(model):
        buffer = (group[0].weight.data_ptr(), (sum(m.weight.shape[0] for m in group), group[0].weight.shape[1]))
        assert count[buffer] == (passes if packed else 0)
        assert all(count[(m.weight.data_ptr(), tuple(m.weight.shape))] == 0 for m in group)
        saved += len(group) - 1
    linears = sum(isinstance(m, Linear) and not n.endswith("kv_b_proj") for n, m in model.named_modules())
    assert len(calls) == passes * (linears - saved)


@pytest.mark.parametrize("raw", [linear_config(), k3_config(5)], ids=["linear", "k3"])
def test_tensor_parallel_narrowed_weights_are_packed(raw):
    """Tensor parallelism narrows the weights before the runner packs them: every group still packs, each member
    keeping this rank's slice of the full tensor."""
    cfg, full = random_model(raw)
    _, model = random_model(raw)
    comm = SimpleNamespace(layout=ParallelLayout(tp=2, ep=2, rank=1), all_reduce_attn=None, all_reduce_world=None)
    plan = ShardPlan()
    shard_attention(model, comm, plan)
    shard_experts(model, comm, plan)
    root = shard_dense(model, comm, plan)
    assert pack_weights(root) == len(groups(root)) > 0
    assert all(is_packed(g) for g in groups(root))
    params, full_params = dict(root.named_parameters()), dict(full.named_parameters())
    assert any(name.endswith("q_proj.weight") for name in plan.params)  # narrowed members among the groups
    for name, p in params.items():
        shard = plan.params.get(name)
        expected = full_params[name] if shard is None else narrow_all(full_params[name], shard.slices)
        assert torch.equal(p, expected), name


def test_meta_placeholders_are_left_alone():
    """Streamed layers hold meta-device placeholders at runner start: packing skips them."""
    with torch.device("meta"):
        model = KimiForCausalLM(ModelConfig.from_dict(linear_config()), torch.float32)
    weights = [m.weight for g in groups(model) for m in g]
    assert pack_weights(model) == 0
    assert all(m.weight is w for m, w in zip((m for g in groups(model) for m in g), weights, strict=True))
