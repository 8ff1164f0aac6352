"""Runs a function on every rank of a gloo shard group of N spawned processes and returns what each rank returned.

The function gets the joined ShardGroup; its return value travels back as bytes (torch.save), never as shared
memory, so a rank may exit before the parent reads it. A rank that raises makes `run_group` raise with its
traceback; a rank that hangs is killed after `timeout_s`. `start_delays` holds a rank's process back before it
reaches the store, as a slow worker start (importing torch on a loaded host) does; the ranks in `absent` never
start, as a worker that died before reaching it.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import queue
import time
import traceback

import torch


def _entry(rank: int, world: int, port: int, timeout_s: float, start_delay_s: float, join_kwargs: dict, fn, args,
           out) -> None:
    import datetime

    import torch.distributed as dist

    from shard_svc.parallel.group import ShardGroup

    torch.set_num_threads(1)
    group = None
    time.sleep(start_delay_s)
    try:
        # As start_group does: the group's join, not the store's constructor, waits for the other ranks.
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        group = ShardGroup.join(rank, world, store, torch.device("cpu"), timeout_s, **join_kwargs)
        result = fn(group, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        out.put((rank, None, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - sent to the parent whole
        out.put((rank, traceback.format_exc(), None))
    finally:
        if group is not None:
            group.close()


def run_group(world: int, fn, *args, timeout_s: float = 150.0, collective_timeout_s: float = 30.0,
              start_delays: dict[int, float] | None = None, absent: frozenset[int] = frozenset(),
              join_kwargs: dict | None = None) -> list:
    """What each started rank's `fn(group, *args)` returned, by rank; the ranks in `absent` are never started."""
    from kimiserve.ports import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    delays = start_delays or {}
    ranks = [r for r in range(world) if r not in absent]
    procs = {r: ctx.Process(target=_entry, args=(r, world, port, collective_timeout_s, delays.get(r, 0.0),
                                                 join_kwargs or {}, fn, args, out), daemon=True)
             for r in ranks}
    for p in procs.values():
        p.start()
    results: dict[int, object] = {}
    errors = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < len(ranks):
            try:
                rank, err, data = out.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in procs.items() if p.exitcode is not None and r not in results]
                if time.monotonic() > deadline or (dead and len(dead) > len(errors)):
                    missing = sorted(set(ranks) - results.keys())
                    errors.append(f"ranks {missing} gave no result (exit codes {[procs[r].exitcode for r in missing]})")
                    break
                continue
            if err:
                errors.append(f"rank {rank}:\n{err}")
            else:
                results[rank] = torch.load(io.BytesIO(data), weights_only=False)
    finally:
        for p in procs.values():
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in ranks]
