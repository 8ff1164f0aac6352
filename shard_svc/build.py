"""`build_engine`: the one way an entry point gets an engine (`kimiserve shard`, `kimiserve generate`, benchmarks).

One process (tp = ep = 1) assembles the engine itself (shard_svc/engine/assemble.py); a shard group (tp or ep > 1)
is started from this process, which becomes rank 0 and returns its engine, the one to step
(shard_svc/parallel/launch.py). It sits above both, so the engine never knows about groups. Options that cannot work
together are refused here, before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from shard_svc.engine.assemble import EngineOptions, assemble_alone, rank_device
from shard_svc.engine.engine import Engine
from shard_svc.parallel.launch import GroupLeader, start_group
from shard_svc.weight_streaming.errors import StreamingConfigError
from shard_svc.weight_streaming.metrics import StreamingMetrics

log = logging.getLogger(__name__)

__all__ = ["BuiltEngine", "EngineOptions", "build_engine"]


@dataclass
class BuiltEngine:
    engine: Engine
    leader: GroupLeader | None = None  # set when this process is rank 0 of a shard group it started

    def close(self, failed: bool = False) -> None:
        """Stops a group's workers (a kill after a failure); nothing to do for one process."""
        if self.leader is not None:
            self.leader.shutdown(failed=failed)


def check_options(opts: EngineOptions) -> None:
    """Refuses combinations that are not supported, naming the flags."""
    if opts.world > 1 and opts.weights.mode == "stream":
        raise StreamingConfigError("--weights stream runs in one process; it is not supported with --tp/--ep")
    if opts.world > 1 and (opts.config.host_kv_bytes or (opts.capacity and opts.capacity.host_kv_bytes != 0)):
        raise StreamingConfigError("--host-kv-gb runs in one process; it is not supported with --tp/--ep")


def build_engine(opts: EngineOptions, metrics: StreamingMetrics | None = None) -> BuiltEngine:
    """The engine `opts` describe. metrics: where weight streaming and host KV offload report (one process only)."""
    check_options(opts)
    if opts.world > 1:
        # Each rank gets a share of this process's threads unless the caller fixed the count per rank.
        threads = opts.cpu_threads or max(1, torch.get_num_threads() // opts.world)
        leader = start_group(dataclasses.replace(opts, cpu_threads=threads))
        return BuiltEngine(leader.engine, leader)
    device = rank_device(opts.device, 0)
    if device.type == "cpu" and opts.cpu_threads is not None:
        torch.set_num_threads(opts.cpu_threads)
    return BuiltEngine(assemble_alone(opts, device, metrics))
