"""The batch runner's settings (router --batch-* flags), read by the runner and by every job it runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BatchConfig:
    db_path: Path
    owner: str = ""  # name this router runs batches under; routers sharing db_path need distinct names
    default_max_concurrency: int = 64
    max_concurrency_limit: int = 4096
    default_window_s: int = 86_400
    lease_s: float = 30.0
    tick_s: float = 0.5
    max_attempts: int = 5  # runs of a request whose shard was unavailable before it fails with "unavailable"
    retry_backoff_s: float = 0.5
