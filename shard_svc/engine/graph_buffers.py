"""What the decode graphs (cuda_graphs.py) and the prefill graphs (prefill_graphs.py) share: their error, which op
implementations may be captured, and the host copy of the block tables they stage into their buffers."""

from __future__ import annotations

from typing import Callable

import torch

from shard_svc.errors import KimiServeError
from shard_svc.ops import EAGER

# Eager references that make no host sync (their files stay untouched, so the declaration lives here).
EAGER_GRAPH_SAFE = frozenset({"linear", "rms_norm", "add_rms_norm", "gated_rms_norm", "glu", "mla_cache_write",
                              "moe_route"})


class CudaGraphError(KimiServeError):
    """A pass cannot use the captured graphs (sizes outside what was captured), or capturing them failed."""


def is_graph_safe(name: str, impl: Callable) -> bool:
    if getattr(impl, "graph_safe", False):
        return True
    return name in EAGER_GRAPH_SAFE and impl is EAGER.get(name)


class TableStager:
    """A host copy of the device block tables: a step rewrites only the rows whose table changed since the last
    step (a new block every block_size tokens, or another sequence in that row), then copies the used columns.
    Columns past a row's own table hold stale block ids that no kernel reads (they lie past its length)."""

    def __init__(self, rows: int, width: int, fill: int):
        self.host = torch.full((rows, width), fill, dtype=torch.int32)
        self.staged: list[list[int] | None] = [None] * rows
        self.rewrites = 0  # rows written since construction (tests)

    def stage(self, tables: list[list[int]]) -> None:
        for i, table in enumerate(tables):
            if self.staged[i] != table:  # a list compare in C: cheap next to building a tensor every step
                self.host[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
                self.staged[i] = list(table)
                self.rewrites += 1
