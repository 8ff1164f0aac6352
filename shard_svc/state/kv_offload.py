"""Host KV offload for the MLA latent cache: a sequence's pages move to (pinned) host memory and back. Part of the
KV manager (beside `pools.py`); the scheduler decides when (shard_svc/engine/scheduler.py).

Sizing follows the model's own layer map (docs/lessons.md#memory-profiles-per-model): the host pool is laid
out `[num_mla, pages, block_size, latent]` like the device cache and indexed by MLA cache index, never by engine
layer index (K3: 93 engine layers, 24 MLA layers at 3, 7, ..., 87, 91, 92 -> host rows 0..23). Every page copy
checks shape and byte size first. Offload copies a sequence's pages out and only then frees its device blocks (after
the copy completes: a freed block may be handed out and written at once); restore reserves fresh device blocks and
copies the pages back, ordered before the next kernel on the compute stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shard_svc.config import ModelConfig
from shard_svc.errors import KVBlocksExhausted
from shard_svc.host_memory import HostMemoryError, alloc_host, check_host_memory
from shard_svc.state.allocators import BlockAllocator
from shard_svc.state.pools import MLAKVCache
from shard_svc.weight_streaming.errors import ByteSizeMismatchError, StreamingConfigError, StreamingError
from shard_svc.weight_streaming.metrics import StreamingMetrics


@dataclass(frozen=True)
class HostKVProfile:
    """What one model's MLA cache looks like, from its own layer map."""

    model_type: str
    num_layers: int  # engine layers
    mla_layers: tuple[int, ...]  # engine layer of each MLA cache index, in index order
    latent_dim: int  # cached width per token and MLA layer: kv_lora_rank + qk_rope_head_dim
    _index: dict[int, int] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "HostKVProfile":
        index = dict(cfg.layer_map.mla_index)
        layers = tuple(sorted(index, key=index.__getitem__))
        if sorted(index.values()) != list(range(len(index))):
            raise StreamingConfigError(f"{cfg.model_type}: MLA cache indices {sorted(index.values())} are not 0..n-1")
        return cls(cfg.model_type, cfg.num_layers, layers, cfg.mla.latent_dim, index)

    @property
    def num_mla(self) -> int:
        return len(self.mla_layers)

    def index_of(self, engine_layer: int) -> int:
        """MLA cache index of an engine layer; a KDA layer has none."""
        if engine_layer not in self._index:
            raise StreamingConfigError(f"{self.model_type}: engine layer {engine_layer} is not an MLA layer "
                                       f"(MLA layers: {list(self.mla_layers)})")
        return self._index[engine_layer]

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_mla * self.latent_dim * dtype.itemsize

    def page_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """One page (block) of one sequence across every MLA layer."""
        return block_size * self.bytes_per_token(dtype)

    def pages_for(self, budget_bytes: int, block_size: int, dtype: torch.dtype) -> int:
        return budget_bytes // self.page_bytes(block_size, dtype)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str, non_blocking: bool) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.nbytes != src.nbytes:
        raise ByteSizeMismatchError(f"{what}: source {list(src.shape)} {src.dtype} ({src.nbytes} bytes) vs destination "
                                    f"{list(dst.shape)} {dst.dtype} ({dst.nbytes} bytes); refusing to copy")
    dst.copy_(src, non_blocking=non_blocking)


class HostKVOffload:
    """Moves whole sequences' MLA pages between the device cache and a host pool of `host_pages` pages."""

    def __init__(self, cache: MLAKVCache, profile: HostKVProfile, host_pages: int,
                 metrics: StreamingMetrics | None = None):
        if cache.kv.shape[0] != profile.num_mla or cache.kv.shape[-1] != profile.latent_dim:
            raise StreamingConfigError(f"device KV cache {list(cache.kv.shape)} does not match the "
                                       f"{profile.model_type} profile ({profile.num_mla} MLA layers, latent "
                                       f"{profile.latent_dim})")
        if host_pages < 1:
            page = profile.page_bytes(cache.block_size, cache.kv.dtype)
            raise HostMemoryError(f"a host KV pool needs at least one page ({page} bytes for {profile.model_type}: "
                                  f"{profile.num_mla} MLA layers x {cache.block_size} tokens x {profile.latent_dim}); "
                                  f"got {host_pages}")
        self.cache, self.profile, self.metrics = cache, profile, metrics
        self.block_size = cache.block_size
        self.cuda = cache.kv.is_cuda
        shape = (profile.num_mla, host_pages, cache.block_size, profile.latent_dim)
        nbytes = host_pages * profile.page_bytes(cache.block_size, cache.kv.dtype)
        check_host_memory(nbytes, None, f"a host KV pool of {host_pages} pages")
        raw, self._registered = alloc_host(nbytes, pinned=self.cuda)
        self.host = raw[:nbytes].view(cache.kv.dtype).view(shape)
        self.pages = BlockAllocator(host_pages, cache.block_size)
        self._blocks: dict[str, int] = {}  # owner -> number of pages offloaded
        self._stream = torch.cuda.Stream(cache.kv.device) if self.cuda else None

    @classmethod
    def for_budget(cls, cache: MLAKVCache, cfg: ModelConfig, budget_bytes: int,
                   metrics: StreamingMetrics | None = None) -> "HostKVOffload":
        profile = HostKVProfile.from_config(cfg)
        return cls(cache, profile, profile.pages_for(budget_bytes, cache.block_size, cache.kv.dtype), metrics)

    def layer_view(self, engine_layer: int) -> torch.Tensor:
        """The host pages of one MLA layer [pages, block_size, latent], by engine layer (mapped to its MLA index)."""
        return self.host[self.profile.index_of(engine_layer)]

    def is_offloaded(self, owner: str) -> bool:
        return owner in self._blocks

    @property
    def num_pages(self) -> int:
        """Pages the host pool holds in all."""
        return self.pages.num_blocks

    @property
    def pages_on_host(self) -> int:
        return self.pages.num_blocks - self.pages.num_free

    def offload(self, owner: str) -> int:
        """Moves every device page of `owner` to the host and frees its device blocks; returns the pages moved."""
        if owner in self._blocks:
            raise StreamingError(f"{owner!r} is already offloaded ({self._blocks[owner]} pages on the host)")
        blocks = list(self.cache.blocks.table(owner))
        if not blocks:
            return 0
        try:
            pages = self.pages.reserve(owner, len(blocks) * self.block_size)
        except KVBlocksExhausted as e:
            raise HostMemoryError(f"host KV pool has {self.pages.num_free} of {self.pages.num_blocks} pages free; "
                                  f"{owner!r} needs {len(blocks)}") from e
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.cache.kv.device))
            with torch.cuda.stream(self._stream):
                self._copy_pages(pages, blocks, to_host=True, owner=owner)
            self._stream.synchronize()  # before the device blocks can be handed to anyone else
        else:
            self._copy_pages(pages, blocks, to_host=True, owner=owner)
        self.cache.release(owner)
        self._blocks[owner] = len(blocks)
        if self.metrics is not None:
            self.metrics.kv_moved(len(blocks), 0, self.pages_on_host)
        return len(blocks)

    def restore(self, owner: str) -> int:
        """Moves `owner`'s pages back into fresh device blocks (raises KVBlocksExhausted, changing nothing, if the
        device cache is full); returns the pages moved."""
        if owner not in self._blocks:
            raise StreamingError(f"{owner!r} has no pages on the host")
        count = self._blocks[owner]
        if self.cache.blocks.table(owner):
            raise StreamingError(f"{owner!r} already holds device blocks; restore would duplicate its cache")
        self.cache.reserve(owner, count * self.block_size)
        blocks = list(self.cache.blocks.table(owner))
        pages = list(self.pages.table(owner))
        if len(blocks) != count or len(pages) != count:
            raise StreamingError(f"{owner!r}: {count} pages offloaded but {len(pages)} host pages and {len(blocks)} "
                                 f"device blocks now")
        self._copy_pages(pages, blocks, to_host=False, owner=owner)  # on the compute stream: ordered before its reads
        self.pages.release(owner)
        del self._blocks[owner]
        if self.metrics is not None:
            self.metrics.kv_moved(0, count, self.pages_on_host)
        return count

    def drop(self, owner: str) -> int:
        """Frees `owner`'s host pages without copying them back (it finished or was cancelled while offloaded);
        returns the pages freed."""
        if owner not in self._blocks:
            raise StreamingError(f"{owner!r} has no pages on the host")
        count = self._blocks.pop(owner)
        self.pages.release(owner)
        if self.metrics is not None:
            self.metrics.kv_moved(0, 0, self.pages_on_host)
        return count

    def _copy_pages(self, pages: list[int], blocks: list[int], to_host: bool, owner: str) -> None:
        for page, block in zip(pages, blocks):
            host, dev = self.host[:, page], self.cache.kv[:, block]  # [num_mla, block_size, latent] each
            what = f"KV of {owner!r} device block {block} {'->' if to_host else '<-'} host page {page}"
            if to_host:
                _copy(host, dev, what, non_blocking=self.cuda)
            else:
                _copy(dev, host, what, non_blocking=self.cuda)

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
            self._registered = False
