"""The `kimiserve` command: one subcommand per job, each living in the package that owns it.

Only the chosen subcommand's module is imported, so client commands start without loading torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, function adding its flags, function running it and returning an exit code, help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "generate": ("shard_svc.generate", "add_args", "run", "run the engine in-process on one prompt"),
    "make-tiny": ("shard_svc.make_tiny", "add_make_tiny_args", "run_make_tiny",
                  "write a tiny random checkpoint in the published format"),
    "up": ("kimiserve.up", "add_args", "run", "start tokenizer, shards and router on localhost"),
    "router": ("router.main", "add_args", "run", "serve the public Router API"),
    "shard": ("shard_svc.server.main", "add_args", "run", "serve one model shard on one device"),
    "chat": ("kimiserve.client", "add_chat_args", "run_chat", "chat with a running router (streams the reply)"),
    "complete": ("kimiserve.client", "add_complete_args", "run_complete", "complete a prompt via the router"),
    "batch": ("kimiserve.batch_cli", "add_args", "run", "submit, inspect, fetch or cancel batch jobs on a router"),
    "bench": ("kimiserve.bench_serve", "add_args", "run",
              "load a running router: concurrency or request-rate sweep, TTFT / TPOT / ITL percentiles, JSON"),
}
# Commands that own their whole argument parser: `kimiserve tokenizer ARGS...` calls main(ARGS).
PASSTHROUGH: dict[str, tuple[str, str]] = {
    "tokenizer": ("tokenizer_svc.main", "serve a checkpoint's tokenizer"),
}


def main(argv: list[str] | None = None) -> int:
    from kimiserve.lifeline import follow_parent

    follow_parent()  # a child of `kimiserve up` stops when up dies
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH:
        return importlib.import_module(PASSTHROUGH[argv[0]][0]).main(argv[1:])
    parser = argparse.ArgumentParser(prog="kimiserve", description="Serve the Kimi hybrid models over gRPC.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, adder, _, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            getattr(importlib.import_module(module), adder)(p)
    for name, (_, help_text) in PASSTHROUGH.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    from kimiserve.logs import setup_logging

    setup_logging(args.command, args.log_level)
    module, _, runner, _ = COMMANDS[args.command]
    return getattr(importlib.import_module(module), runner)(args)


if __name__ == "__main__":
    sys.exit(main())
