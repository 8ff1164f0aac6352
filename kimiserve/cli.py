"""The `kimiserve` command: one subcommand per job, each living in the package that owns it.

Only the chosen subcommand's module is imported, so client commands start without loading torch. Every
subcommand's `--help` lists each flag with its default. A user's mistake (a missing model directory, a malformed
config.json, missing tokenizer files, a bad certificate path...) is one line on stderr and exit code 2; `--debug`
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kimiserve.logs import LOG_FORMATS

# subcommand -> (module, function adding its flags, function running it and returning an exit code, help)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "generate": ("shard_svc.generate", "add_args", "run", "run the engine in-process on one prompt"),
    "make-tiny": ("shard_svc.make_tiny", "add_make_tiny_args", "run_make_tiny",
                  "write a tiny random checkpoint in the published format"),
    "up": ("kimiserve.up", "add_args", "run", "start tokenizer, shards and router on localhost"),
    "router": ("router.main", "add_args", "run", "serve the public Router API"),
    "shard": ("shard_svc.server.main", "add_args", "run", "serve one model shard on one device"),
    "tokenizer": ("tokenizer_svc.main", "add_args", "run", "serve a checkpoint's tokenizer"),
    "chat": ("kimiserve.client", "add_chat_args", "run_chat", "chat with a running router (streams the reply)"),
    "complete": ("kimiserve.client", "add_complete_args", "run_complete", "complete a prompt via the router"),
    "batch": ("kimiserve.batch_cli", "add_args", "run", "submit, inspect, fetch or cancel batch jobs on a router"),
    "bench": ("kimiserve.bench_serve", "add_args", "run",
              "load a running router: concurrency or request-rate sweep, TTFT / TPOT / ITL percentiles, JSON"),
}
# Errors that mean the user asked for something that cannot be done (module -> class names). Only modules already
# imported are looked at: an error class of a module the command never loaded cannot have been raised.
USER_ERRORS: dict[str, tuple[str, ...]] = {
    "shard_svc.errors": ("ConfigError", "CheckpointError"),
    "tokenizer_svc.errors": ("TokenizerLoadError", "UnsupportedModelType"),
    "kimiserve.security": ("SecurityConfigError",),
    "shard_svc.ops": ("OpBackendError",),
    "shard_svc.weight_streaming.errors": ("StreamingConfigError",),
    "router.batch.errors": ("BatchStoreError",),
    "kimiserve.ports": ("PortInUse",),
}
OS_USER_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def _shows_default(action: argparse.Action) -> bool:
    """An option with a default worth printing (0 and 0.0 are; None, "", a switch's False and SUPPRESS are not: the
    help text says what leaving them unset means)."""
    return bool(action.option_strings) and not (action.default is None or action.default is False
                                                or action.default in ("", argparse.SUPPRESS))


class DefaultsFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default (flags without help text get one that says only that)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not _shows_default(action):
            return text
        return f"{text} (default: %(default)s)".strip()

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and _shows_default(action):
            action.help = "(default: %(default)s)"  # a flag without help text still shows its default
        return super()._format_action(action)


def _global_flags(p: argparse.ArgumentParser, defaults: bool) -> None:
    """--log-level, --log-format and --debug, before or after the subcommand (after wins). After it their default is
    SUPPRESS (a value given before the subcommand stands), so its help states the real default itself."""
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    shown = (lambda v: "") if defaults else (lambda v: f" (default: {v})")
    p.add_argument("--log-level", default=d("INFO"), help="DEBUG, INFO, WARNING or ERROR" + shown("INFO"))
    p.add_argument("--log-format", choices=LOG_FORMATS, default=d("auto"),
                   help="auto: readable text on a terminal, JSON lines otherwise" + shown("auto"))
    p.add_argument("--debug", action="store_true", default=d(False),
                   help="show the traceback of an error instead of one line")


def _user_error_types() -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = list(OS_USER_ERRORS)
    for module, names in USER_ERRORS.items():
        if module in sys.modules:
            found += [getattr(sys.modules[module], n) for n in names if hasattr(sys.modules[module], n)]
    return tuple(found)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimiserve", description="Serve the Kimi hybrid models over gRPC.",
                                     formatter_class=DefaultsFormatter)
    _global_flags(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (module, adder, _, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=DefaultsFormatter)
        if name == chosen:
            getattr(importlib.import_module(module), adder)(p)
            _finish(p)
    return parser


def _finish(p: argparse.ArgumentParser) -> None:
    """The global flags and the defaults in --help on a subcommand and on its own subcommands (`batch submit`)."""
    p.formatter_class = DefaultsFormatter
    _global_flags(p, defaults=False)
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                _finish(nested)


def main(argv: list[str] | None = None) -> int:
    from kimiserve.lifeline import follow_parent

    follow_parent()  # a child of `kimiserve up` stops when up dies
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    from kimiserve.logs import setup_logging

    setup_logging(args.command, args.log_level, args.log_format)
    module, _, runner, _ = COMMANDS[args.command]
    try:
        return getattr(importlib.import_module(module), runner)(args)
    except Exception as e:  # noqa: BLE001 - sorted below: the user's mistake in one line, anything else raised
        if args.debug or not isinstance(e, _user_error_types()):
            raise
        sys.stderr.write(f"kimiserve {args.command}: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
