"""Wiring of batch jobs into the router (called from router/main.py): flags, config, and one object that owns the
store, the runner and the batch RPCs for the router's lifetime."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from router.batch.config import BatchConfig
from router.batch.execute import BatchExecutor
from router.batch.files import FileStore
from router.batch.metrics import BatchMetrics
from router.batch.runner import BatchRunner
from router.batch.store import BatchStore
from router.generation import Generation
from router.metrics import RouterMetrics
from router.shard_client import ShardClient


def default_db_path() -> Path:
    """The embedded default: $XDG_CACHE_HOME/kimiserve/batches.sqlite3 (~/.cache when unset)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kimiserve" / "batches.sqlite3"


def add_batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-db", type=Path, default=None,
                   help="SQLite file of batch jobs, requests and results (WAL); default: "
                        "$XDG_CACHE_HOME/kimiserve/batches.sqlite3")
    p.add_argument("--batch-max-concurrency", type=int, default=64,
                   help="requests of one batch running at once, when CreateBatch does not say")
    p.add_argument("--batch-owner", default=None,
                   help="name this router runs batches under (default HOST:PORT); a router restarted with the same "
                        "name resumes its batches at once, others take them over after a 30 s lease")


def batch_config_from_args(a: argparse.Namespace) -> BatchConfig:
    return BatchConfig(db_path=a.batch_db or default_db_path(), owner=a.batch_owner or f"{a.host}:{a.port}",
                       default_max_concurrency=a.batch_max_concurrency)


def shard_capacity(shards: list[ShardClient]) -> int:
    """Sequences the healthy shards can run at once (their state slots): batch requests use only this much."""
    return sum(s.info.capacity.state_slots for s in shards if s.view.healthy and s.info is not None)


class BatchWiring:
    def __init__(self, cfg: BatchConfig, generation: Generation, metrics: RouterMetrics):
        self.store = BatchStore(cfg.db_path)
        self.files = FileStore(cfg.db_path)  # the HTTP API's uploaded files, in the same SQLite file
        generation.admission.batch_capacity = lambda: shard_capacity(generation.shards)
        self.runner = BatchRunner(self.store, BatchExecutor(generation), BatchMetrics(metrics.registry), cfg,
                                  generation.admission)

    def start(self) -> None:
        self.runner.start()

    async def stop(self, grace_s: float) -> None:
        """Stops the runner; the stores stay open for the front ends until close()."""
        await self.runner.stop(grace_s)

    def close(self) -> None:
        self.files.close()
        self.store.close()
