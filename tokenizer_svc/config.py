"""The tokenizer service's one typed config, built once (by the CLI or `main`) and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kimiserve.security import ServerTls


@dataclass(frozen=True)
class TokenizerServerConfig:
    model_dir: Path  # checkpoint directory: tokenizer files, config.json, optional chat template
    model_name: str = ""  # name clients put in `model`; empty: the directory's name
    model_type: str | None = None  # overrides config.json's model_type (e.g. a directory with tokenizer files only)
    host: str = "127.0.0.1"
    port: int = 50052
    metrics_port: int | None = None  # Prometheus /metrics HTTP port; None: no metrics endpoint
    max_message_chars: int = 1_000_000  # per chat message (content + tool-call arguments)
    max_text_chars: int = 8_000_000  # per Tokenize text
    grace_s: float = 5.0  # on SIGTERM: how long in-flight RPCs may finish
    tls: ServerTls | None = None  # TLS on the gRPC port; with a client CA, mTLS (router certs only)
    health_port: int | None = None  # plaintext grpc.health.v1-only port (kubelet probes when TLS is on)
    internal_token_file: Path | None = None  # its token is required on every call but health / reflection
    # Threads that encode, render and decode whole sequences (the only work off the event loop). A fixed number:
    # every thread that allocates keeps a malloc arena of its own, so RSS follows the count of threads ever started
    # (issue 33: asyncio's default pool started up to min(32, cores + 4) of them, one at a time, as load peaked).
    work_threads: int = 2

    @property
    def served_name(self) -> str:
        return self.model_name or self.model_dir.resolve().name
