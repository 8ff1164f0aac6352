"""Load a checkpoint directory in the published on-disk format into a KimiForCausalLM.

Order of work: parse config.json; build the model on the meta device; open the safetensors files (memory-mapped)
and validate every tensor's presence, shape and dtype against the expected table, raising one error that lists
all problems; only then materialise each parameter on the target device, reading each stored tensor once, and
check every parameter was filled (never run on init values or stale memory: docs/lessons.md#no-silent-wrong-output).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from shard_svc.checkpoint.files import CheckpointFiles
from shard_svc.checkpoint.fill import check_all_filled, check_nothing_on_meta, fill_sources, fill_value, load_dtype
from shard_svc.checkpoint.names import tensor_specs
from shard_svc.checkpoint.validate import Fill, plan_fills
from shard_svc.config import ModelConfig
from shard_svc.errors import CheckpointMismatch
from shard_svc.model import KimiForCausalLM

log = logging.getLogger(__name__)

PROGRESS_DELAY_S = 2.0  # the bar appears only when loading takes longer than this


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = None) -> tuple[ModelConfig, KimiForCausalLM]:
    """(config, model with every parameter loaded on `device`). dtype None: the checkpoint's declared dtype."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    dtype = load_dtype(dtype, cfg)
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype)
    specs = tensor_specs(cfg, model)
    with CheckpointFiles(model_dir, keep_prefix=cfg.tensor_prefix) as files:
        fills = plan_fills(specs, files, cfg)
        params = _materialise(model, fills, files, torch.device(device))
    model.load_state_dict(params, strict=True, assign=True)
    model.requires_grad_(False)  # serving never trains; no autograd bookkeeping on any parameter
    check_nothing_on_meta(model)
    log.info("loaded %s (%s, %d tensors) on %s as %s", model_dir, cfg.model_type, sum(files.reads.values()),
             device, dtype)
    return cfg, model.eval()


def _materialise(model: KimiForCausalLM, fills: list[Fill], files: CheckpointFiles,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """Fresh tensors for every parameter, each slice written from the checkpoint exactly once."""
    meta = dict(model.named_parameters())
    out = {name: torch.empty(p.shape, dtype=p.dtype, device=device) for name, p in meta.items()}
    filled: dict[str, set[int | None]] = {name: set() for name in meta}
    from tqdm import tqdm  # here, not at the top: the training script imports this package where tqdm is absent

    bar = tqdm(fills, desc=f"loading {files.dir.name}", unit="tensor", file=sys.stderr, delay=PROGRESS_DELAY_S,
               disable=not sys.stderr.isatty())
    for fill in bar:
        target = out[fill.param] if fill.expert is None else out[fill.param][fill.expert]
        value = fill_value(fill, files, target)
        if value.shape != target.shape:  # the validator's table and the model disagree: never copy partially
            raise CheckpointMismatch(f"{fill_sources(fill, files)}: gives {list(value.shape)} for {fill.param} slice "
                                     f"{list(target.shape)}", {"shape": [fill.param]})
        target.copy_(value)
        filled[fill.param].add(fill.expert)
    check_all_filled(meta, filled, stacked={f.param for f in fills if f.expert is not None})
    return out
