"""Rank 0 starts a shard group on one host: it hosts the rendezvous store, spawns one worker process per other
rank (`python -m shard_svc.parallel.worker`), watches them, and sends every rank the same EngineOptions.

`build_engine` (shard_svc/build.py) calls `start_group` for `kimiserve generate --tp N --ep N` and
`kimiserve shard --tp N --ep N`; the CLI process is rank 0 and faces the user or the router. Every rank loads its
slice and builds its engine around it with the same `assemble_engine`, stepping through the group's StepSync.
Rank r uses `cuda:{first + r}` (first: the --device index), or the CPU.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from shard_svc.config import ModelConfig
from shard_svc.engine.assemble import (DEFAULT_GROUP_TIMEOUT_S, EngineOptions, assemble_engine, rank_device,
                                       resolve_dtype)
from shard_svc.engine.engine import Engine
from shard_svc.parallel.errors import GroupError
from shard_svc.parallel.group import ShardGroup
from shard_svc.parallel.layout import ParallelLayout
from shard_svc.parallel.loading import GROUP_LOAD_FORMATS
from shard_svc.parallel.sync import StepSync

log = logging.getLogger(__name__)


def _rank_engine(group: ShardGroup, opts: EngineOptions) -> Engine:
    """This rank's slice of the model, and the engine around it, in lockstep with the other ranks."""
    layout = ParallelLayout(opts.tp, opts.ep, group.rank)
    cfg, model = GROUP_LOAD_FORMATS[opts.load_format](str(opts.model_dir), group.device,
                                                      resolve_dtype(opts.dtype, group.device),
                                                      group.model_comm(layout))
    return assemble_engine(opts, group.device, cfg, model, sync=StepSync(group, layout, cfg))


def build_rank(group: ShardGroup, opts: EngineOptions) -> Engine:
    """Every rank: its model slice and engine. Load errors are gathered, so rank 0 reports every rank's failure."""
    engine, error = None, None
    try:
        engine = _rank_engine(group, opts)
    except Exception as e:  # noqa: BLE001 - reported below, with the other ranks' results
        log.exception("loading this rank's model slice failed", extra={"rank": group.rank})
        error = e
    group.barrier(opts.load_timeout_s, "waiting for every rank to load its slice")
    results = group.all_gather_object(None if error is None else f"{type(error).__name__}: {error}",
                                      "gathering load results")
    failed = [f"rank {r}: {msg}" for r, msg in enumerate(results) if msg]
    if failed:
        if error is not None and group.rank == 0:
            raise error
        raise GroupError("shard group failed to start: " + "; ".join(failed))
    return engine


def _exit_description(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Watchdog:
    """Watches the worker processes. A worker that exits while the group runs is logged at once, named in every
    later GroupError, and passed to each `on_lost` callback (the server reports NOT_SERVING at once, before a
    collective notices); if rank 0 is then stuck (an NCCL collective that never errors), the process exits after
    `grace_s` rather than hang."""

    def __init__(self, procs: dict[int, subprocess.Popen], grace_s: float):
        self.procs, self.grace_s = procs, grace_s
        self.on_lost: list[Callable[[str], None]] = []
        self.lost: list[str] = []
        self._lost_ranks: set[int] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def describe(self, wait_s: float = 1.0) -> str:
        """The ranks known dead, for a GroupError's message. A collective usually fails the moment a peer's socket
        closes, a little before this thread's next poll, so look (and wait briefly) now."""
        deadline = time.monotonic() + wait_s
        while not self._check() and time.monotonic() < deadline:
            time.sleep(0.05)
        return f"; {'; '.join(self.lost)}" if self.lost else ""

    def _check(self) -> bool:
        """Records newly exited workers; True if any worker is known lost."""
        with self._lock:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is None or rank in self._lost_ranks:
                    continue
                what = f"rank {rank} (pid {proc.pid}) {_exit_description(code)}"
                self._lost_ranks.add(rank)
                self.lost.append(what)
                log.error("shard group rank lost; the group fails", extra={"rank": rank, "pid": proc.pid,
                                                                          "detail": what})
                for callback in self.on_lost:
                    callback(what)
                if not self._stopped.is_set():
                    threading.Thread(target=self._escalate, args=(what,), daemon=True).start()
            return bool(self.lost)

    def _run(self) -> None:
        while not self._stopped.wait(0.2):
            self._check()

    def _escalate(self, what: str) -> None:
        if not self._stopped.wait(self.grace_s):
            log.critical("shard group did not fail within the grace period after a rank was lost; exiting",
                         extra={"detail": what, "grace_s": self.grace_s})
            logging.shutdown()
            os._exit(1)


class GroupLeader:
    """Rank 0 of a group it started: the engine (the one to step), the workers and their watchdog."""

    def __init__(self, opts: EngineOptions, group: ShardGroup, procs: dict[int, subprocess.Popen], watchdog: Watchdog):
        self.opts, self.group, self.procs, self.watchdog = opts, group, procs, watchdog
        self.engine: Engine | None = None

    def shutdown(self, failed: bool = False, timeout_s: float = 30.0) -> None:
        """Stops the workers (a stop message when the group is healthy, else a kill) and leaves the group."""
        self.watchdog.stop()
        if not failed and self.engine is not None:
            try:
                self.engine.sync.stop()
            except GroupError as e:
                log.error("could not send the stop message", extra={"error": str(e)})
                failed = True
        deadline = time.monotonic() + (0 if failed else timeout_s)
        for rank, proc in self.procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank did not stop; killing it", extra={"rank": rank, "pid": proc.pid})
                proc.kill()
                proc.wait()
        self.group.close()


def _loopback_listener() -> socket.socket:
    """The store's listening socket, on 127.0.0.1: a TCPStore given only a port listens on every interface, and it
    authenticates nothing (anyone who reached it could write the group's keys)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    return listener


def start_group(opts: EngineOptions) -> GroupLeader:
    """Rank 0: validates the layout against the checkpoint's config, spawns ranks 1..N-1, loads every slice."""
    ParallelLayout(opts.tp, opts.ep).check(ModelConfig.from_dir(opts.model_dir))
    device = rank_device(opts.device, 0)
    if device.type == "cpu" and opts.cpu_threads is not None:
        torch.set_num_threads(opts.cpu_threads)
    timeout = datetime.timedelta(seconds=opts.group_timeout_s)
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())  # the workers log as this process does
    listener = _loopback_listener()
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], opts.world, is_master=True, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=listener.detach())
    procs = {}
    for rank in range(1, opts.world):
        cmd = [sys.executable, "-m", "shard_svc.parallel.worker", "--rank", str(rank), "--world-size",
               str(opts.world), "--store-port", str(store.port), "--device", str(rank_device(opts.device, rank)),
               "--timeout-s", str(opts.group_timeout_s), "--log-level", log_level]
        procs[rank] = subprocess.Popen(cmd)
        log.info("shard group rank started", extra={"rank": rank, "pid": procs[rank].pid, "world": opts.world})
    watchdog = Watchdog(procs, grace_s=opts.group_timeout_s + 10.0)
    watchdog.start()
    group = None
    try:
        group = ShardGroup.join(0, opts.world, store, device, opts.group_timeout_s, failure_hint=watchdog.describe)
        leader = GroupLeader(opts, group, procs, watchdog)
        group.broadcast_object(opts, "sending the engine options")
        leader.engine = build_rank(group, opts)
    except BaseException:
        watchdog.stop()
        for proc in procs.values():
            proc.kill()
            proc.wait()
        if group is not None:
            group.close()
        raise
    log.info("shard group ready", extra={"world": opts.world, "tp": opts.tp, "ep": opts.ep,
                                         "model": str(Path(opts.model_dir)), "pids": [p.pid for p in procs.values()]})
    return leader


def add_group_args(p) -> None:
    """--tp / --ep / --group-timeout, shared by `kimiserve shard`, `generate` and `up`."""
    g = p.add_argument_group("shard group: one model on several devices (one process per device)")
    g.add_argument("--tp", type=int, default=1, help="attention tensor parallelism: KDA/MLA heads split tp ways")
    g.add_argument("--ep", type=int, default=1,
                   help="expert parallelism: routed experts split ep ways; the group has max(tp, ep) ranks")
    g.add_argument("--group-timeout", type=float, default=DEFAULT_GROUP_TIMEOUT_S,
                   help="seconds a collective may wait for a silent rank before the group fails")
