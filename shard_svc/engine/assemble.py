"""What one process builds: the options every entry point fills in, and the one place an Engine is put together
around a loaded model (the whole model on one device, or one rank's slice of a shard group).

`assemble_alone` loads the checkpoint for one process (resident or streamed) and assembles its engine;
`shard_svc/parallel/launch.py` loads each rank's slice and assembles it with the group's StepSync. `build_engine`
(shard_svc/build.py) chooses between the two, so a shard server, `kimiserve generate` and a group's ranks build the
same engine from the same options.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shard_svc.config import ModelConfig
from shard_svc.engine.capacity import CapacityRequest
from shard_svc.engine.cuda_graphs import enable_cuda_graphs, graph_engine_config
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.grammar import Grammars
from shard_svc.engine.memory_profile import attention_peak_context
from shard_svc.engine.sizing import sized_config
from shard_svc.engine.step_sync import ALONE, StepSync
from shard_svc.engine.warmup import warm_up
from shard_svc.model import KimiForCausalLM
from shard_svc.ops import select_ops
from shard_svc.ops.batch_invariant import batch_invariant
from shard_svc.weight_streaming.metrics import StreamingMetrics
from shard_svc.weight_streaming.mode import WeightsArgs, load_for_serving
from shard_svc.weight_streaming.streamer import WeightStreamer

log = logging.getLogger(__name__)

DEFAULT_GROUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EngineOptions:
    """Everything an entry point decides about the engine it runs. A shard group's rank 0 sends this object whole
    to every other rank, so no rank can be started with different values."""

    model_dir: Path
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"; rank r of a group uses cuda:N+r
    dtype: str | None = None  # "float32" | "bfloat16"; None: bfloat16 on CUDA, float32 on the CPU
    op_backend: str = "auto"  # auto | eager | triton (shard_svc/ops)
    load_format: str = "safetensors"  # or "dummy": random weights from config.json alone (benchmarks)
    config: EngineConfig = field(default_factory=EngineConfig)  # capacity, host KV, prefix cache
    weights: WeightsArgs = field(default_factory=WeightsArgs)  # resident | stream | auto (shard_svc/weight_streaming)
    enforce_eager: bool = False  # no decode CUDA graphs (shard_svc/engine/cuda_graphs.py)
    grammars: bool = True  # load the checkpoint's vocabulary for response_format (False: such requests refused)
    warm_up: bool = False  # on CUDA, run every kind of pass once before returning (shard_svc/engine/warmup.py)
    tp: int = 1  # shard group: attention heads split tp ways (shard_svc/parallel)
    ep: int = 1  # routed experts split ep ways; the group has max(tp, ep) ranks, one process each
    group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S  # any collective, and rank 0's silence while idle, longer fails
    load_timeout_s: float = 1800.0  # every rank must have loaded its slice within this
    cpu_threads: int | None = None  # torch intra-op threads per process on a CPU device; None: leave torch's
    # The operator's capacity flags, sized once the weights are placed (shard_svc/engine/sizing.py): unset ones from
    # device memory on a GPU, the fixed defaults elsewhere; `config` then gives only the block size, the prefix state
    # interval and host entries. None: `config` is used as it is (benchmarks, tests, `kimiserve generate`).
    capacity: CapacityRequest | None = None
    batch_invariant: bool = False  # ops that round a row alike in any pass (shard_svc/ops/batch_invariant.py)

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)


def rank_device(device: str, rank: int) -> torch.device:
    d = torch.device(device)
    return torch.device("cuda", (d.index or 0) + rank) if d.type == "cuda" else d


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    return getattr(torch, dtype or ("bfloat16" if device.type == "cuda" else "float32"))


def assemble_alone(opts: EngineOptions, device: torch.device, metrics: StreamingMetrics | None = None) -> Engine:
    """The engine of a process that runs the whole model: resident loads the checkpoint as is, stream keeps decoder
    layers in host memory. metrics: where weight streaming and host KV offload report (None: nowhere)."""
    cfg, model, streamer = load_for_serving(opts.model_dir, opts.load_format, device,
                                            resolve_dtype(opts.dtype, device), opts.weights, metrics)
    return assemble_engine(opts, device, cfg, model, streamer=streamer, metrics=metrics)


def assemble_engine(opts: EngineOptions, device: torch.device, cfg: ModelConfig, model: KimiForCausalLM, *,
                    sync: StepSync = ALONE, streamer: WeightStreamer | None = None,
                    metrics: StreamingMetrics | None = None) -> Engine:
    """The engine around a loaded model: the whole model (sync ALONE), or a rank's slice of a shard group stepping in
    lockstep with the other ranks through `sync`. streamer: the weight streamer of a streamed model."""
    dtype = resolve_dtype(opts.dtype, device)
    in_group = sync.world > 1
    # Streamed layers are fetched during the pass, and a group's steps are not captured: both run eager.
    eager = opts.enforce_eager or streamer is not None or in_group
    # In a group every rank advances each sequence's response_format matcher, so all agree on where it ends.
    grammars = (Grammars.for_checkpoint(Path(opts.model_dir), cfg.vocab_size, cfg.eos_token_ids)
                if opts.grammars else None)
    ops = select_ops(device, opts.op_backend)
    # Batch invariance is for prompt rows (a restore's short tail must round as one pass over the prompt would);
    # decode-only passes keep the fast ops.
    prefill_ops = batch_invariant(ops) if opts.batch_invariant else ops

    def build(config: EngineConfig) -> Engine:
        engine = Engine(cfg, model, prefill_ops, device, graph_engine_config(config, device, eager), sync=sync,
                        kv_metrics=metrics, grammars=grammars, advertised=config,
                        decode_ops=None if prefill_ops is ops else ops)
        if streamer is not None:
            streamer.attach(engine.runner)
        return engine

    config = opts.config
    if opts.capacity is not None:
        config = sized_config(opts.capacity, opts.config, cfg, device, dtype, build,
                              None if eager else enable_cuda_graphs, in_group=in_group,
                              peak_context=functools.partial(attention_peak_context, prefill_ops))
    engine = build(config)
    if not eager:
        enable_cuda_graphs(engine)  # off, with the reason logged, where the device or ops rule graphs out
    if opts.warm_up and not in_group and device.type == "cuda":  # compile every kernel shape before serving
        warm_up(engine)
    return engine
