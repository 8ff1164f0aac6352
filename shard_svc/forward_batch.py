"""Per-step metadata for one forward pass over packed sequences, built by the runner, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard_svc.ops import Ops
from shard_svc.state.pools import KDAStatePool, MLAKVCache


@dataclass
class ForwardBatch:
    cu_seqlens: torch.Tensor  # [B+1] int64 offsets of each sequence's new tokens in the packed input
    ctx_lens: torch.Tensor  # [B] int64 tokens already in state / cache before this pass
    state_slots: torch.Tensor  # [B] int64 KDA pool slot of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32 MLA cache blocks of each sequence
    slot_mapping: torch.Tensor  # [T] int64 flat cache position (block * block_size + offset) of each new token
    is_decode: bool  # every sequence has exactly one new token


@dataclass
class ForwardContext:
    """Everything a layer needs besides its input: the batch layout, the pools and the op backend."""

    batch: ForwardBatch
    kda_pool: KDAStatePool
    kv_cache: MLAKVCache
    ops: Ops
