"""Shard groups: one model served by N processes, one per device (torch.distributed: NCCL on GPUs, gloo on CPUs).

- layout.py: which slice each rank holds (attention heads over tp, routed experts over ep, the rest over the world);
- tensor_parallel.py / expert_parallel.py: edits to a built model that slice it and add the collectives;
- loading.py: each rank loads only its slice from the checkpoint (or makes dummy weights for it);
- group.py: process groups and every collective, each failing as a named GroupError under a timeout;
- sync.py: the engine hook keeping every rank's replicated engine in lockstep with rank 0;
- launch.py (rank 0) / worker.py (ranks 1..N-1): spawning, the rendezvous, the watchdog; loop.py: the server loop.
"""

from shard_svc.parallel.errors import GroupDiverged, GroupError, ParallelConfigError
from shard_svc.parallel.layout import ParallelLayout

__all__ = ["GroupDiverged", "GroupError", "ParallelConfigError", "ParallelLayout"]
