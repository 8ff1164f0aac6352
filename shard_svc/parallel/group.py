"""The process groups of a shard group and every collective it runs, each failing as a named GroupError.

Two planes, both joined through one TCPStore hosted by rank 0:
- control (gloo, CPU, always): step messages, plan/state digests, sampled tokens, the load barrier. It works the
  same on GPU hosts, so a dead rank is noticed by a socket error (or the timeout) even while NCCL is idle;
- data (NCCL on CUDA, gloo on CPU): the activations of the forward pass (all-reduce, all-gather).
Every collective has the group's timeout, so a hung or dead rank raises instead of blocking forever.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import pickle
import socket
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from shard_svc.parallel.errors import GroupError
from shard_svc.parallel.layout import ParallelLayout

log = logging.getLogger(__name__)

# Seconds every rank's process gets to reach the store before the group fails. Starting a worker means importing
# torch (and, on a GPU, creating a CUDA context): several seconds on a loaded host, longer than a short
# --group-timeout, which bounds the collectives of a running group, not process start-up.
ARRIVAL_TIMEOUT_S = 120.0
ARRIVAL_POLL_S = 0.5  # how often a waiting rank looks for a rank known dead (the leader's watchdog)


def loopback_interface() -> str:
    """The loopback interface's name (lo on Linux, lo0 on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")


def digest(obj: object) -> int:
    """A 56-bit digest of a picklable value, equal on every rank for equal values (unlike hash(), which is salted
    per process)."""
    return int.from_bytes(hashlib.blake2b(pickle.dumps(obj, protocol=4), digest_size=7).digest(), "little")


class ShardGroup:
    """This process's membership: rank, world size, device, the control and data planes."""

    def __init__(self, rank: int, world: int, device: torch.device, timeout_s: float):
        self.rank, self.world, self.device, self.timeout_s = rank, world, device, timeout_s
        self.data: dist.ProcessGroup | None = None
        # Set by the launcher on rank 0: "; rank 1 (pid ..) was killed by SIGKILL", put in every GroupError.
        self.failure_hint: Callable[[], str] = lambda: ""
        self._closed = False

    @classmethod
    def join(cls, rank: int, world: int, store: dist.Store, device: torch.device, timeout_s: float,
             failure_hint: Callable[[], str] | None = None,
             arrival_timeout_s: float = ARRIVAL_TIMEOUT_S) -> "ShardGroup":
        """Joins the group (all `world` ranks must call this): waits up to max(timeout_s, arrival_timeout_s) for
        every rank's process to reach the store, then builds the process groups, whose collectives time out after
        `timeout_s`."""
        self = cls(rank, world, device, timeout_s)
        if failure_hint is not None:
            self.failure_hint = failure_hint
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # NCCL collectives raise in the calling thread after the timeout instead of hanging (untested here: no
            # multi-GPU machine was lent while this was written).
            os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        # gloo listens on the address the host name resolves to (a pod's IP) unless told an interface, and it
        # authenticates nothing; every rank of a group is on this host, so loopback is enough.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        self._await_arrivals(store, max(timeout_s, arrival_timeout_s))
        with self._guard("joining the group"):
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
            self.data = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout)
        log.info("joined shard group", extra={"rank": rank, "world": world, "device": str(device)})
        return self

    def _await_arrivals(self, store: dist.Store, timeout_s: float) -> None:
        """Marks this rank arrived and waits for the others; a rank known dead (failure_hint) or still missing at
        the deadline fails the group by name."""
        what = "waiting for every rank's process to start"
        keys = [f"kimiserve/arrived/{r}" for r in range(self.world)]
        started = time.monotonic()
        with self._guard(what):
            store.set(keys[self.rank], b"1")
            while True:
                try:
                    store.wait(keys, datetime.timedelta(seconds=ARRIVAL_POLL_S))
                    return
                except dist.DistStoreError:  # this poll's timeout; a lost store raises DistNetworkError
                    pass
                hint = self.failure_hint()
                waited = time.monotonic() - started
                if hint or waited > timeout_s:
                    missing = [r for r, key in enumerate(keys) if not store.check([key])]
                    raise GroupError(f"shard group rank {self.rank} of {self.world}: {what} failed{hint}: rank(s) "
                                     f"{missing} had not arrived after {waited:.1f} s (limit {timeout_s:g} s)")

    def close(self) -> None:
        if not self._closed and dist.is_initialized():
            self._closed = True
            dist.destroy_process_group()

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        try:
            yield
        except GroupError:
            raise
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses; all mean the group broke
            raise GroupError(f"shard group rank {self.rank} of {self.world}: {what} failed{self.failure_hint()}: "
                             f"{e}") from e

    # -- control plane (CPU, gloo) -------------------------------------------------------------------------------
    def broadcast_object(self, obj: object, what: str) -> object:
        """Rank 0's `obj` on every rank."""
        box = [obj if self.rank == 0 else None]
        with self._guard(what):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: object, what: str) -> list[object]:
        out: list[object] = [None] * self.world
        with self._guard(what):
            dist.all_gather_object(out, obj)
        return out

    def all_gather_ints(self, values: list[int], what: str) -> list[list[int]]:
        """Every rank's `values` (same length on every rank), indexed by rank."""
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        with self._guard(what):
            dist.all_gather(out, mine)
        return [t.tolist() for t in out]

    def broadcast_tensor(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """In place: rank 0's values of the CPU tensor `t` (same shape and dtype on every rank)."""
        with self._guard(what):
            dist.broadcast(t, src=0)
        return t

    def barrier(self, timeout_s: float, what: str) -> None:
        """Waits for every rank up to `timeout_s` (the load barrier: longer than a step's timeout); names a missing
        rank."""
        with self._guard(what):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)

    # -- data plane: the model's collectives -----------------------------------------------------------------------
    def model_comm(self, layout: ParallelLayout) -> "ModelComm":
        """The forward pass's communicators for `layout`; every rank must call this, in the same order."""
        if layout.world != self.world or layout.rank != self.rank:
            raise GroupError(f"layout for rank {layout.rank} of {layout.world} used on rank {self.rank} of "
                             f"{self.world}")
        attn = self.data
        if 1 < layout.tp < layout.world:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            with self._guard("creating the attention groups"):
                for ranks in layout.attention_groups():  # new_group is collective: every rank creates every group
                    g = dist.new_group(ranks, backend="nccl" if self.device.type == "cuda" else "gloo",
                                       timeout=timeout)
                    if self.rank in ranks:
                        attn = g
        return ModelComm(self, layout, attn)


class ModelComm:
    """All-reduce over the attention group or the world, and the vocab all-gather; no-ops on groups of one."""

    def __init__(self, group: ShardGroup, layout: ParallelLayout, attn: dist.ProcessGroup | None):
        self.group, self.layout, self._attn = group, layout, attn

    def all_reduce_attn(self, t: torch.Tensor) -> torch.Tensor:
        if self.layout.tp > 1:
            with self.group._guard("attention all-reduce"):
                dist.all_reduce(t, group=self._attn)
        return t

    def all_reduce_world(self, t: torch.Tensor) -> torch.Tensor:
        if self.layout.world > 1:
            with self.group._guard("all-reduce"):
                dist.all_reduce(t, group=self.group.data)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., world * n], rank-major (the vocab-parallel logits)."""
        if self.layout.world == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.layout.world)]
        with self.group._guard("logits all-gather"):
            dist.all_gather(parts, t, group=self.group.data)
        return torch.cat(parts, dim=-1)
