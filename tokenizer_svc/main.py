"""The tokenizer service's command: `kimiserve tokenizer --model DIR --port P` (also `python -m tokenizer_svc ...`).

Its flags are added to the `kimiserve` parser like every other subcommand's, so `--help` shows each default, global
flags (`--log-level`, `--log-format`, `--debug`) work, and a user's mistake (missing tokenizer files, a bad
certificate path) is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kimiserve import internal_auth, security, tracing
from tokenizer_svc.config import TokenizerServerConfig

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    d = TokenizerServerConfig(model_dir=Path("."))
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (tokenizer files, config.json)")
    p.add_argument("--model-name", default=d.model_name, help="name clients use; empty: the directory's name")
    p.add_argument("--model-type", default=d.model_type, help="override config.json's model_type")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="gRPC port (0: any free port, logged)")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics port; default: off")
    p.add_argument("--max-message-chars", type=int, default=d.max_message_chars)
    p.add_argument("--max-text-chars", type=int, default=d.max_text_chars)
    p.add_argument("--grace-s", type=float, default=d.grace_s, help="on SIGTERM, in-flight RPCs may finish this long")
    p.add_argument("--work-threads", type=_at_least_one, default=d.work_threads,
                   help="threads that encode and render (texts are encoded in parallel, up to this many at once)")
    security.add_server_tls_args(p)
    internal_auth.add_server_args(p)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1 thread, got {value}")
    return value


def config_from_args(args: argparse.Namespace) -> TokenizerServerConfig:
    tls = security.server_tls_from_args(args)
    return TokenizerServerConfig(
        model_dir=args.model,
        model_name=args.model_name,
        model_type=args.model_type,
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        max_message_chars=args.max_message_chars,
        max_text_chars=args.max_text_chars,
        grace_s=args.grace_s,
        tls=tls,
        health_port=args.health_port,
        work_threads=args.work_threads,
        internal_token_file=internal_auth.check_server_args(args, args.host, tls, "tokenizer"),
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT. Named startup errors propagate: the CLI reports the user's in one line."""
    cfg = config_from_args(args)
    tracing.setup_or_exit("tokenizer")
    # Imported here, after logging is configured, so anything logged while grpc / tokenizers load is structured too.
    from tokenizer_svc.server import serve

    serve(cfg)
    return 0
