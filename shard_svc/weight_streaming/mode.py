"""`--weights resident|stream|auto`, the prefetch depth and the pinned-memory budget: one place for the CLI hooks.

`auto` keeps the resident path unless the resident model cannot fit the device; it logs which mode it chose and why.
The resident branch calls the load format exactly as before, so resident serving is unchanged.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from shard_svc.config import ModelConfig
from shard_svc.weight_streaming.errors import StreamingConfigError

log = logging.getLogger(__name__)

WEIGHT_MODES = ("auto", "resident", "stream")
GiB = float(1 << 30)
# auto: stream when the resident weights would take more than this share of the device's free memory (the rest is
# for the KDA state pool, the KV cache and activations).
RESIDENT_SHARE = 0.9


@dataclass(frozen=True)
class WeightsArgs:
    mode: str = "auto"
    prefetch_depth: int = 2
    num_slots: int | None = None
    pinned_memory_gb: float | None = None


def add_weights_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=WEIGHT_MODES, default="auto",
                   help="resident: every weight on the device; stream: decoder layers stay in pinned host memory and "
                        "stream through a ring of device slots; auto: stream only when the model does not fit")
    p.add_argument("--prefetch-depth", type=int, default=2, help="stream: layers copied ahead of the one computing")
    p.add_argument("--weight-slots", type=int, default=None,
                   help="stream: device slots in the ring (default: prefetch depth + 1)")
    p.add_argument("--pinned-memory-gb", type=float, default=None,
                   help="stream: host memory the streamed layers may page-lock (default: what the host has available)")


def weights_args(args: argparse.Namespace) -> WeightsArgs:
    return WeightsArgs(getattr(args, "weights", "auto"), getattr(args, "prefetch_depth", 2),
                       getattr(args, "weight_slots", None), getattr(args, "pinned_memory_gb", None))


def resident_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes the resident model takes on the device (experts dequantised, as the resident loader stores them)."""
    from shard_svc.model import KimiForCausalLM

    with torch.device("meta"):
        model = KimiForCausalLM(cfg, dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def choose_mode(requested: str, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(mode, why). Logged by the caller."""
    if requested not in WEIGHT_MODES:
        raise StreamingConfigError(f"--weights {requested!r}: choose one of {WEIGHT_MODES}")
    if requested != "auto":
        return requested, f"--weights {requested}"
    if device.type != "cuda":
        return "resident", f"device {device} computes from host memory"
    need = resident_bytes(cfg, dtype)
    free, _total = torch.cuda.mem_get_info(device)
    if need <= RESIDENT_SHARE * free:
        return "resident", f"the resident model ({need / GiB:.1f} GiB) fits in {free / GiB:.1f} GiB free on {device}"
    return "stream", (f"the resident model needs {need / GiB:.1f} GiB but {device} has {free / GiB:.1f} GiB free "
                      f"({RESIDENT_SHARE:.0%} usable for weights)")


def load_for_serving(model_dir: Path, load_format: str, device: torch.device, dtype: torch.dtype,
                     weights: WeightsArgs, metrics=None):
    """(cfg, model, streamer or None). Call `streamer.attach(engine.runner)` once the engine exists. metrics: a
    StreamingMetrics the streamer reports to (None: no metrics)."""
    from shard_svc.checkpoint import LOAD_FORMATS

    mode = weights.mode
    if mode == "auto":
        mode, why = choose_mode(mode, ModelConfig.from_dir(model_dir), device, dtype)
    else:
        mode, why = choose_mode(mode, None, device, dtype)  # type: ignore[arg-type]
    log.info("weights: %s (%s)", mode, why)
    if mode == "resident":
        cfg, model = LOAD_FORMATS[load_format](model_dir, device=device, dtype=dtype)
        return cfg, model, None
    if load_format != "safetensors":
        raise StreamingConfigError(f"--weights stream loads safetensors checkpoints; --load-format {load_format} is "
                                   "not supported with it")
    from shard_svc.weight_streaming.host_loader import load_streamed
    from shard_svc.weight_streaming.streamer import StreamOptions, WeightStreamer

    budget = None if weights.pinned_memory_gb is None else int(weights.pinned_memory_gb * GiB)
    cfg, model, host = load_streamed(model_dir, device, dtype, budget_bytes=budget)
    options = StreamOptions(prefetch_depth=weights.prefetch_depth, num_slots=weights.num_slots,
                            pinned_budget_bytes=budget)
    return cfg, model, WeightStreamer(cfg, model, host, device, options, metrics)
