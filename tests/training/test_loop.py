"""The optimisation loop on tiny random models: bf16 parameters learn through fp32 master weights (one batch is
memorised), router biases move toward under-used experts, and the schedule warms up and decays as specified."""

from __future__ import annotations

import pytest
import torch

from shard_svc.config import ModelConfig
from tests.engine.conftest import k3_config, linear_config
from training.data import Batch
from training.loop import PhaseReport, Schedule, Trainer
from training.models import init_model

CONFIGS = {"linear": linear_config(), "k3-13-mxfp4": k3_config(13, routed_expert_hidden_size=32,
                                                               moe_intermediate_size=32)}


def test_schedule_warms_up_then_decays_to_the_floor():
    s = Schedule(peak_lr=1.0, warmup=10, total=110, floor=0.1)
    assert s.lr(0) == pytest.approx(0.1) and s.lr(9) == pytest.approx(1.0)
    assert s.lr(10) == pytest.approx(1.0) and s.lr(60) == pytest.approx(0.55) and s.lr(110) == pytest.approx(0.1)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_batch_is_memorised_in_bf16_and_router_biases_move(name):
    cfg = ModelConfig.from_dict(CONFIGS[name])
    model = init_model(cfg, torch.bfloat16, torch.device("cpu"), seed=0)
    trainer = Trainer(model, batch=2, seq_len=32, chunk=16, mxfp4_experts=name.endswith("mxfp4"))
    tokens = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens[:, :-1], tokens[:, 1:])
    report = trainer.run(lambda rows: batch, Schedule(1e-2, 5, 40), PhaseReport(), log_every=39, name=name)
    with torch.no_grad():
        loss = float(trainer.loss(batch))
    assert report.steps == 40 and report.tokens == 40 * 64
    assert loss < 0.5 * torch.log(torch.tensor(float(cfg.vocab_size))), f"{name}: loss {loss} after 40 steps"
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if n.endswith("proj.weight"))
    assert any(bool(b.abs().sum() > 0) for b in trainer.biases), "router biases never moved"
