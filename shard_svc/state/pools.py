"""Fixed-address state pools. One allocation per pool, laid out (layers, slots|blocks, ...), indexed by the
LayerMap's KDA / MLA indices so per-layer views stay contiguous and a CUDA graph can capture them."""

from __future__ import annotations

import torch

from shard_svc.config import ModelConfig
from shard_svc.ops.precision import acc_dtype
from shard_svc.state.allocators import BlockAllocator, SlotAllocator


class KDAStatePool:
    """Recurrent state [num_kda, slots, H, K, V] fp32 and conv state [num_kda, slots, 3*H*K, W-1]."""

    def __init__(self, cfg: ModelConfig, num_slots: int, device: torch.device, conv_dtype: torch.dtype,
                 num_heads: int | None = None):
        """num_heads: the heads this process holds (a shard-group rank holds H / tp of them); None: all H."""
        k = cfg.kda
        n = cfg.layer_map.num_kda
        heads = k.num_heads if num_heads is None else num_heads
        if not 0 < heads <= k.num_heads or k.num_heads % heads:
            raise ValueError(f"KDA pool for {heads} heads: must divide the model's {k.num_heads} KDA heads")
        self.layer_map = cfg.layer_map
        self.num_heads = heads
        self.recurrent = torch.zeros(n, num_slots, heads, k.head_dim, k.head_dim, dtype=acc_dtype(conv_dtype),
                                     device=device)
        self.conv = torch.zeros(n, num_slots, 3 * heads * k.head_dim, k.conv_kernel - 1, dtype=conv_dtype,
                                device=device)
        self.slots = SlotAllocator(num_slots)

    def layer(self, engine_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(recurrent [slots, H, K, V], conv [slots, 3HK, W-1]) views of one KDA layer, by engine layer index."""
        i = self.layer_map.kda_slot_of(engine_layer)
        return self.recurrent[i], self.conv[i]

    def copy_slot(self, src: int, dst: int) -> None:
        """The recurrent and conv state of every KDA layer from one slot into another (prefix cache snapshots)."""
        self.recurrent[:, dst].copy_(self.recurrent[:, src])
        self.conv[:, dst].copy_(self.conv[:, src])

    def zero_slot(self, slot: int) -> None:
        """Called when a slot is handed to a new sequence, before its first forward."""
        self.recurrent[:, slot].zero_()
        self.conv[:, slot].zero_()

    @property
    def bytes_per_slot(self) -> int:
        per = self.recurrent[:, 0].numel() * self.recurrent.element_size()
        return per + self.conv[:, 0].numel() * self.conv.element_size()


class MLAKVCache:
    """Paged latent cache [num_mla, blocks, block_size, kv_lora + rope] with block tables per sequence."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype):
        self.layer_map = cfg.layer_map
        self.kv = torch.zeros(cfg.layer_map.num_mla, num_blocks, block_size, cfg.mla.latent_dim, dtype=dtype,
                              device=device)
        self.blocks = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size

    def layer(self, engine_layer: int) -> torch.Tensor:
        return self.kv[self.layer_map.mla_slot_of(engine_layer)]

    def reserve(self, owner: str, num_tokens: int) -> None:
        """Make room for `num_tokens` in total for `owner`; new blocks are zeroed."""
        for block in self.blocks.reserve(owner, num_tokens):
            self.kv[:, block].zero_()

    def release(self, owner: str) -> None:
        self.blocks.release(owner)

    def copy_block(self, src: int, dst: int) -> None:
        """One block's latent entries in every MLA layer (a cached prefix's last, partly filled block)."""
        self.kv[:, dst].copy_(self.kv[:, src])
