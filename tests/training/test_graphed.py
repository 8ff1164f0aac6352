"""The captured training pass (training/graphed.py): a training forward and backward make no host sync and copy no
host data, for both model families (what lets them be captured as a CUDA graph); a CPU batch is refused by name; on a
GPU, steps replayed from the graph give the losses of eager steps."""

from __future__ import annotations

import collections
from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shard_svc.config import ModelConfig
from tests.engine.conftest import k3_config, linear_config
from training.data import Batch
from training.graphed import CapturedPassError
from training.loop import PhaseReport, Schedule, Trainer
from training.models import init_model

CONFIGS = {"linear": linear_config(), "k3-13-mxfp4": k3_config(13, routed_expert_hidden_size=32,
                                                               moe_intermediate_size=32)}
# ops whose result the host must wait for (a value read back, or an output sized by the data), and host data made a
# tensor (`torch.tensor(values, device=...)`: a copy from pageable host memory, which stream capture refuses)
HOST_SYNCS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "unique", "_unique2",
              "unique_consecutive", "masked_select", "bincount", "repeat_interleave", "tolist", "lift_fresh",
              "lift_fresh_copy"}


class OpsSeen(TorchDispatchMode):
    """Counts, by name, the ops of a pass that `flagged` picks out."""

    def __init__(self, flagged: Callable[[Any, tuple, dict, Any], bool]):
        super().__init__()
        self.flagged = flagged
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.flagged(func, args, kwargs, out):
            self.seen[func.__name__.split(".")[0]] += 1
        return out


def host_syncs() -> OpsSeen:
    return OpsSeen(lambda func, args, kwargs, out: func.__name__.split(".")[0] in HOST_SYNCS)


def host_tensors() -> OpsSeen:
    """Ops given or giving a host tensor (more than a scalar) while the model is elsewhere: on a GPU each would be a
    copy between host and device inside the pass (an index built with torch.arange and no device, say)."""
    return OpsSeen(lambda func, args, kwargs, out: any(
        isinstance(t, torch.Tensor) and t.dim() > 0 and t.device.type == "cpu"
        for t in tree_flatten((args, kwargs, out))[0]))


def trainer_and_batch(name: str, device: str, cuda_graphs: bool = False) -> tuple[Trainer, Batch]:
    cfg = ModelConfig.from_dict(CONFIGS[name])
    model = init_model(cfg, torch.float32, torch.device("cpu"), seed=0).to(device)
    trainer = Trainer(model, batch=2, seq_len=32, chunk=16, mxfp4_experts=name.endswith("mxfp4"),
                      cuda_graphs=cuda_graphs)
    tokens = torch.randint(0, 200, (2, 33), generator=torch.Generator().manual_seed(0)).to(device)
    return trainer, Batch(tokens[:, :-1], tokens[:, 1:])


@pytest.mark.parametrize("name", CONFIGS)
def test_a_training_pass_makes_no_host_sync(name):
    trainer, batch = trainer_and_batch(name, "cpu")
    syncs = host_syncs()
    with syncs:
        trainer.loss(batch).backward()
        assert not syncs.seen, f"{name}: host syncs in the pass: {dict(syncs.seen)}"
        float(trainer.loss(batch))  # the detector sees a value read back
    assert syncs.seen["_local_scalar_dense"] + syncs.seen["item"] >= 1


@pytest.mark.parametrize("name", CONFIGS)
def test_a_training_pass_on_the_meta_device_touches_no_host_tensor(name):
    trainer, batch = trainer_and_batch(name, "meta")
    found = host_tensors()
    with found:
        trainer.loss(batch).backward()
        assert not found.seen, f"{name}: host tensors in the pass: {dict(found.seen)}"
        batch.inputs[torch.arange(1)]  # the detector sees a host index
    assert found.seen


def test_a_cpu_batch_is_refused_by_name():
    trainer, batch = trainer_and_batch("linear", "cpu", cuda_graphs=True)
    with pytest.raises(CapturedPassError, match="CUDA device, got cpu"):
        trainer.step(batch, 1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need the GPU")
@pytest.mark.parametrize("name", CONFIGS)
def test_replayed_steps_give_the_eager_losses(name):
    losses = {}
    for graphs in (False, True):
        trainer, batch = trainer_and_batch(name, "cuda", cuda_graphs=graphs)
        seq = torch.randint(0, 200, (6, 2, 33), generator=torch.Generator().manual_seed(1)).cuda()
        batches = iter([Batch(s[:, :-1], s[:, 1:]) for s in seq])
        report = trainer.run(lambda rows: next(batches), Schedule(1e-2, 2, 6), PhaseReport(), log_every=1,
                             name=name)
        losses[graphs] = [loss for _, loss in report.losses]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
