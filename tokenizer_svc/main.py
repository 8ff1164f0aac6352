"""Command-line entry point of the tokenizer service: `python -m tokenizer_svc --model DIR --port P`.

`kimiserve tokenizer ...` calls `main(argv)` with the same arguments.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from kimiserve import security, tracing
from kimiserve.logs import setup_logging
from tokenizer_svc.config import TokenizerServerConfig
from tokenizer_svc.errors import TokenizerServiceError

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    d = TokenizerServerConfig(model_dir=Path("."))
    p = argparse.ArgumentParser(prog="kimiserve tokenizer", description="Serve a checkpoint's tokenizer over gRPC.")
    p.add_argument("--model", type=Path, required=True, help="checkpoint directory (tokenizer files, config.json)")
    p.add_argument("--model-name", default=d.model_name, help="name clients use; default: the directory's name")
    p.add_argument("--model-type", default=d.model_type, help="override config.json's model_type")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="gRPC port (0: any free port, logged)")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics port; default: off")
    p.add_argument("--max-message-chars", type=int, default=d.max_message_chars)
    p.add_argument("--max-text-chars", type=int, default=d.max_text_chars)
    p.add_argument("--grace-s", type=float, default=d.grace_s)
    p.add_argument("--log-level", default="INFO")
    security.add_server_tls_args(p)
    return p


def config_from_args(args: argparse.Namespace) -> TokenizerServerConfig:
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
        tls=security.server_tls_from_args(args),
        health_port=args.health_port,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("tokenizer", args.log_level)
    # Imported after logging is configured, so anything logged while grpc / tokenizers load is structured too.
    from tokenizer_svc.server import serve

    try:
        tracing.setup("tokenizer")  # on only when the OTEL_* environment asks for traces
        serve(config_from_args(args))
    except (TokenizerServiceError, security.SecurityConfigError, tracing.TracingConfigError, OSError) as exc:
        log.error("tokenizer service failed to start: %s", exc, extra={"error_type": type(exc).__name__})
        return 1
    return 0
