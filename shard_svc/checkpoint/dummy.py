"""`--load-format dummy`: random weights made directly on the device from config.json alone.

For benchmarks at full model shapes without a checkpoint on disk. Values are scaled like a trained model's
(unit-ish activations, router biases small, decays in range) so every path does representative work.
"""

from __future__ import annotations

import math

import torch

from shard_svc.config import ModelConfig
from shard_svc.model import KimiForCausalLM


def dummy_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> KimiForCausalLM:
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_(False)
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(torch.empty(p.shape, device=device).uniform_(1, 16, generator=gen)))
            elif leaf in ("dt_bias", "e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, device=device, generator=gen) * 0.1)
            elif p.dim() == 1:  # norm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    return model.eval()


def load_dummy(model_dir, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
    """Same contract as `load_model`, from config.json alone (`--load-format dummy`)."""
    cfg = ModelConfig.from_dir(model_dir)
    return cfg, dummy_model(cfg, device, dtype or getattr(torch, cfg.torch_dtype))
