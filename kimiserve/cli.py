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
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kimiserve", description="Serve the Kimi hybrid models over gRPC.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, adder, _, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            getattr(importlib.import_module(module), adder)(p)
    args = parser.parse_args(argv)
    from kimiserve.logs import setup_logging

    setup_logging(args.command, args.log_level)
    module, _, runner, _ = COMMANDS[args.command]
    return getattr(importlib.import_module(module), runner)(args)


if __name__ == "__main__":
    sys.exit(main())
