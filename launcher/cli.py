"""The `kimiserve` command: one subcommand per job, each living in the package that owns it, run in the frame of
kimiserve/command.py (parser, global flags, logging, one-line user errors)."""

from __future__ import annotations

import argparse
import sys

from kimiserve import command

COMMANDS: dict[str, command.Command] = {
    "generate": ("shard_svc.generate", "add_args", "run", "run the engine in-process on one prompt"),
    "make-tiny": ("shard_svc.make_tiny", "add_make_tiny_args", "run_make_tiny",
                  "write a tiny random checkpoint in the published format"),
    "up": ("launcher.up", "add_args", "run", "start tokenizer, shards and router on localhost"),
    "router": ("router.main", "add_args", "run", "serve the public Router API"),
    "shard": ("shard_svc.server.main", "add_args", "run", "serve one model shard on one device"),
    "tokenizer": ("tokenizer_svc.main", "add_args", "run", "serve a checkpoint's tokenizer"),
    "chat": ("launcher.client", "add_chat_args", "run_chat",
             "chat with a running router (streams the reply; its thinking, if any, to stderr)"),
    "complete": ("launcher.client", "add_complete_args", "run_complete", "complete a prompt via the router"),
    "batch": ("launcher.batch_cli", "add_args", "run", "submit, inspect, fetch or cancel batch jobs on a router"),
    "bench": ("launcher.bench_serve", "add_args", "run",
              "load a running router: concurrency or request-rate sweep, TTFT / TPOT / ITL percentiles, JSON"),
}
USER_ERRORS: dict[str, tuple[str, ...]] = {
    "shard_svc.errors": ("ConfigError", "CheckpointError"),
    "kimiserve.tokenizer_files.errors": ("TokenizerLoadError",),
    "tokenizer_svc.errors": ("UnsupportedModelType",),
    "kimiserve.security": ("SecurityConfigError",),
    "shard_svc.ops": ("OpBackendError",),
    "shard_svc.weight_streaming.errors": ("StreamingConfigError",),
    "router.batch.errors": ("BatchStoreError",),
    "kimiserve.ports": ("PortInUse",),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    return command.build_parser(COMMANDS, argv)


def main(argv: list[str] | None = None) -> int:
    return command.main(COMMANDS, USER_ERRORS, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
