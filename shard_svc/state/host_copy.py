"""Host copies of one sequence's state: its KDA state slot and the MLA KV blocks of its tokens.

Two things take a state off the device pools and later put it into a slot and blocks of another owner: the prefix
cache's host tier (shard_svc/engine/prefix_host.py) and a sequence moving to another shard (engine/handoff.py).
A copy holds every block of its tokens, the last partial one too, and is complete when `save` returns (blocking
copies), so the caller may free the slot and blocks at once. On a GPU the host tensors are pinned, so the copies back
can overlap the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard_svc.errors import KimiServeError, KVBlocksExhausted
from shard_svc.state.pools import KDAStatePool, MLAKVCache


class HostCopyError(KimiServeError):
    """A host copy does not match the sizes it should have (a bug, or a state made by another model: nothing is
    restored)."""


@dataclass
class HostState:
    recurrent: torch.Tensor  # [num_kda, H, K, V] fp32, host
    conv: torch.Tensor  # [num_kda, 3HK, W-1], host
    kv: torch.Tensor  # [num_mla, blocks, block_size, latent], host: every block of the tokens

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.recurrent, self.conv, self.kv))

    def parts(self) -> dict[str, torch.Tensor]:
        return {"recurrent": self.recurrent, "conv": self.conv, "kv": self.kv}


class HostCopier:
    """Copies one sequence's state between the device pools and host tensors."""

    def __init__(self, kda_pool: KDAStatePool, kv_cache: MLAKVCache):
        self.kda_pool, self.kv_cache = kda_pool, kv_cache
        self.pin = kv_cache.kv.is_cuda  # pinned host memory only where there is a device to copy to

    def host_like(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pin)

    def save(self, slot: int, blocks: list[int], num_tokens: int) -> HostState:
        """Host copies of the state in `slot` and the KV `blocks` holding `num_tokens` tokens."""
        bs = self.kv_cache.block_size
        if len(blocks) != -(-num_tokens // bs):
            raise HostCopyError(f"a state of {num_tokens} tokens holds {len(blocks)} KV blocks of {bs}; expected "
                                f"{-(-num_tokens // bs)}")
        pool, kv = self.kda_pool, self.kv_cache.kv
        index = torch.tensor(blocks, dtype=torch.long, device=kv.device)
        parts = [pool.recurrent[:, slot], pool.conv[:, slot], kv.index_select(1, index)]
        host = [self.host_like(p) for p in parts]
        for dst, src in zip(host, parts):
            dst.copy_(src)
        return HostState(*host)

    def check(self, state: HostState, num_tokens: int, what: str) -> None:
        """HostCopyError naming both shapes when `state` (of `num_tokens` tokens) is not what this shard's pools
        hold: another model, another head slice, another KV block size or dtype. `what` names the state."""
        pool, kv = self.kda_pool, self.kv_cache.kv
        blocks = -(-num_tokens // self.kv_cache.block_size)
        want = {"recurrent": (tuple(pool.recurrent[:, 0].shape), pool.recurrent.dtype),
                "conv": (tuple(pool.conv[:, 0].shape), pool.conv.dtype),
                "kv": ((kv.shape[0], blocks, *kv.shape[2:]), kv.dtype)}
        for name, tensor in state.parts().items():
            shape, dtype = want[name]
            if (tuple(tensor.shape), tensor.dtype) != (shape, dtype):
                raise HostCopyError(f"{what}: its {name} is {tuple(tensor.shape)} {tensor.dtype}; this shard holds "
                                    f"{shape} {dtype} for {num_tokens} tokens (KV blocks of "
                                    f"{self.kv_cache.block_size})")

    def load(self, state: HostState, owner: str, slot: int, num_tokens: int) -> None:
        """Copies a host state into `owner` (holding the fresh state slot `slot` and no KV blocks): the state into
        the slot, the KV into fresh blocks of the owner's table. The copies are queued on the current stream, so the
        next forward reads them."""
        pool, cache = self.kda_pool, self.kv_cache
        if cache.blocks.table(owner):
            raise HostCopyError(f"{owner!r} already holds KV blocks {cache.blocks.table(owner)}; a host state "
                                "restores into a sequence without any")
        try:
            blocks = cache.blocks.reserve(owner, num_tokens)
        except KVBlocksExhausted as e:  # admission counted these blocks: reaching here is a bug, not a full cache
            raise HostCopyError(f"{owner!r}: no room for the {state.kv.shape[1]} KV blocks of its host state "
                                f"({num_tokens} tokens): {e}") from e
        if len(blocks) != state.kv.shape[1]:
            raise HostCopyError(f"{owner!r}: {len(blocks)} KV blocks reserved for a host state of "
                                f"{state.kv.shape[1]} blocks ({num_tokens} tokens)")
        index = torch.tensor(blocks, dtype=torch.long, device=cache.kv.device)
        # non_blocking from pinned memory: the host allocator keeps the pages until the copy has run, even if the
        # host copy is dropped meanwhile.
        cache.kv.index_copy_(1, index, state.kv.to(cache.kv.device, non_blocking=self.pin))
        pool.recurrent[:, slot].copy_(state.recurrent, non_blocking=self.pin)
        pool.conv[:, slot].copy_(state.conv, non_blocking=self.pin)
