"""Per-step metadata for one forward pass over packed sequences, built by the runner, read by every layer.

A layer reads and writes its own views of the state pools and nothing else of them, so the context names only those
views (KDAStateLayers, MLACacheLayers); the pools that provide them (shard_svc/state/pools.py) sit above the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from shard_svc.ops import Ops
from shard_svc.ops.host_lengths import HostLengths
from shard_svc.ops.kda.snapshots import StateSnapshots


class KDAStateLayers(Protocol):
    def layer(self, engine_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(recurrent [slots, H, K, V], conv [slots, 3HK, W-1]) views of one KDA layer, by engine layer index."""


class MLACacheLayers(Protocol):
    def layer(self, engine_layer: int) -> torch.Tensor:
        """The paged latent cache [blocks, block_size, latent] of one MLA layer, by engine layer index."""


@dataclass
class ForwardBatch:
    cu_seqlens: torch.Tensor  # [B+1] int64 offsets of each sequence's new tokens in the packed input
    ctx_lens: torch.Tensor  # [B] int64 tokens already in state / cache before this pass
    state_slots: torch.Tensor  # [B] int64 KDA pool slot of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32 MLA cache blocks of each sequence
    slot_mapping: torch.Tensor  # [T] int64 flat cache position (block * block_size + offset) of each new token
    is_decode: bool  # every sequence has exactly one new token
    snapshots: StateSnapshots | None = None  # KDA states to copy out inside this (prefill) pass
    host_lengths: HostLengths | None = None  # the lengths above on the host (None: read them back if needed)


@dataclass
class ForwardContext:
    """Everything a layer needs besides its input: the batch layout, the pools and the op backend."""

    batch: ForwardBatch
    kda_pool: KDAStateLayers
    kv_cache: MLACacheLayers
    ops: Ops
