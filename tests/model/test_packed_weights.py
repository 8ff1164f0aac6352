"""Packed KDA q/k/v weights (KDAttention.pack, done by the model runner): the checkpoint-named parameters become
views of one buffer, nothing is held twice, and a tiny checkpoint generates the same tokens and bitwise the same
logits as with the unpacked weights (the per-step concatenation path)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shard_svc.checkpoint.loader import load_model
from shard_svc.config import ModelConfig
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.model import KimiForCausalLM
from shard_svc.model.kda import KDAttention
from shard_svc.model.layers import packed_rows
from shard_svc.ops import select_ops
from tests.engine.conftest import linear_config

CPU = torch.device("cpu")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(10, 60)), [42] * 9]


def kda_layers(model) -> list[KDAttention]:
    return [m for m in model.modules() if isinstance(m, KDAttention)]


def unpack(model) -> None:
    """Each q/k/v projection and conv weight in its own storage again: the concatenating path."""
    for attn in kda_layers(model):
        for module in (*attn._projections(), *attn._convs()):
            module.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=False)


def generate(cfg, model, packed: bool):
    engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU, EngineConfig(num_state_slots=3, num_kv_blocks=64))
    if not packed:
        unpack(model)
    assert all((packed_rows([m.weight for m in a._projections()]) is not None) == packed for a in kda_layers(model))
    seqs = [engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, ignore_eos=True), keep_prompt_logits=True)
            for i, p in enumerate(PROMPTS)]
    while engine.has_work():
        engine.step()
    return seqs


@pytest.mark.parametrize("family", ["tiny_linear", "tiny_k3_small"])
def test_packed_weights_keep_names_values_and_outputs(family, request):
    cfg, model = load_model(request.getfixturevalue(family), dtype="float32")
    before = {name: t.clone() for name, t in model.state_dict().items()}
    packed = generate(cfg, model, packed=True)
    # names and values unchanged; q/k/v of each layer share one storage and no bytes are held twice
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[n], before[n]) for n in before)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == sum(p.nbytes for p in model.parameters())
    for attn in kda_layers(model):
        for parts in ([m.weight for m in attn._projections()], [m.weight for m in attn._convs()]):
            assert len({p.untyped_storage().data_ptr() for p in parts}) == 1

    cfg, model = load_model(request.getfixturevalue(family), dtype="float32")
    unpacked = generate(cfg, model, packed=False)
    for a, b in zip(packed, unpacked):
        assert a.output == b.output
        assert torch.equal(torch.cat(a.prompt_logits), torch.cat(b.prompt_logits))
        assert torch.equal(torch.cat(a.step_logits), torch.cat(b.step_logits))


def test_meta_placeholders_are_left_alone():
    """Streamed layers hold meta-device placeholders at runner start: packing skips them."""
    with torch.device("meta"):
        model = KimiForCausalLM(ModelConfig.from_dict(linear_config()), torch.float32)
    attn = kda_layers(model)[0]
    weights = [m.weight for m in attn._projections()]
    assert not attn.pack()
    assert all(m.weight is w for m, w in zip(attn._projections(), weights))
