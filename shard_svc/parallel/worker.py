"""A follower rank (1..N-1) of a shard group: joins, receives the EngineOptions, loads its slice, then runs every step
rank 0 announces. It never sees the router; it exits 0 on rank 0's stop message and 1 when the group fails.

Started by `shard_svc.parallel.launch.start_group`: `python -m shard_svc.parallel.worker --rank R ...`.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import threading

import torch

from shard_svc.engine.engine import Engine
from shard_svc.parallel.errors import GroupError
from shard_svc.engine.pass_record import PassRecord

log = logging.getLogger(__name__)


def follow(engine: Engine) -> None:
    """Applies each of rank 0's messages and steps when told to, until the stop message. Logs each prefill pass
    this rank ran (rank 0 exports every rank's pass metrics; each rank's log line is its own)."""
    sync = engine.sync
    while True:
        msg = sync.receive()
        sync.apply(engine, msg)
        if msg.kind == "stop":
            return
        if msg.kind == "step":
            for p in engine.step().passes:
                if p.kind == "prefill":
                    PassRecord.of(p, sync.group.rank, sync.group.world).log()


def _exit_with_parent() -> None:
    """Rank 0 spawned this process: if it dies (even by SIGKILL, mid-collective) this rank must not live on."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            threading.Event().wait(1.0)
            if os.getppid() != parent:
                log.error("rank 0 (the parent process) is gone; exiting", extra={"parent_pid": parent})
                logging.shutdown()
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shard_svc.parallel.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store-host", default="127.0.0.1")
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--timeout-s", type=float, required=True)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    from kimiserve.logs import setup_logging

    setup_logging(f"shard-rank{args.rank}", args.log_level)
    _exit_with_parent()
    import torch.distributed as dist

    from shard_svc.parallel.group import ShardGroup
    from shard_svc.parallel.launch import build_rank

    try:
        store = dist.TCPStore(args.store_host, args.store_port, args.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=args.timeout_s))
        group = ShardGroup.join(args.rank, args.world_size, store, torch.device(args.device), args.timeout_s)
        opts = group.broadcast_object(None, "receiving the engine options")
        if group.device.type == "cpu" and opts.cpu_threads is not None:
            torch.set_num_threads(opts.cpu_threads)
        follow(build_rank(group, opts))
    except GroupError as e:
        log.error("shard group failed; this rank exits", extra={"rank": args.rank, "error": str(e)})
        return 1
    except Exception:  # noqa: BLE001 - logged whole; rank 0 sees this rank's exit
        log.exception("rank failed", extra={"rank": args.rank})
        return 1
    group.close()
    log.info("rank stopped", extra={"rank": args.rank})
    return 0


if __name__ == "__main__":
    sys.exit(main())
