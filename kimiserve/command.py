"""The frame every `kimiserve` command runs in: its parser, global flags, logging and the sorting of its errors.

launcher/cli.py names the commands of the `kimiserve` CLI; a service's own `python -m` entry runs its one command in
the same frame, so both behave alike. Only the chosen command's module is imported, so client commands start
without loading torch. Every command's `--help` lists each flag with its default. A user's mistake (a missing model
directory, a malformed config.json, missing tokenizer files, a bad certificate path...) is one line on stderr and
exit code 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping

from kimiserve.lifeline import follow_parent
from kimiserve.logs import LOG_FORMATS, setup_logging

# A command: (module, function adding its flags, function running it and returning an exit code, help).
Command = tuple[str, str, str, str]
# Errors that mean the user asked for something that cannot be done: module -> class names. Only modules already
# imported are looked at: an error class of a module the command never loaded cannot have been raised.
UserErrors = Mapping[str, tuple[str, ...]]
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


def _user_error_types(user_errors: UserErrors) -> tuple[type[BaseException], ...]:
    found: list[type[BaseException]] = list(OS_USER_ERRORS)
    for module, names in user_errors.items():
        if module in sys.modules:
            found += [getattr(sys.modules[module], n) for n in names if hasattr(sys.modules[module], n)]
    return tuple(found)


def build_parser(commands: Mapping[str, Command], argv: list[str]) -> argparse.ArgumentParser:
    """The `kimiserve` parser with one subcommand per entry of `commands`; only the one named in `argv` gets its
    flags (importing its module)."""
    parser = argparse.ArgumentParser(prog="kimiserve", description="Serve the Kimi hybrid models over gRPC.",
                                     formatter_class=DefaultsFormatter)
    _global_flags(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if a in commands), None)
    for name, (module, adder, _, help_text) in commands.items():
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


def main(commands: Mapping[str, Command], user_errors: UserErrors, argv: list[str]) -> int:
    """Parses `argv` (a subcommand and its flags), runs the subcommand and returns its exit code: 2 with one line on
    stderr for an error of `user_errors` (or a missing file), unless --debug."""
    follow_parent()  # a child of `kimiserve up` stops when up dies
    args = build_parser(commands, argv).parse_args(argv)
    setup_logging(args.command, args.log_level, args.log_format)
    module, _, runner, _ = commands[args.command]
    try:
        return getattr(importlib.import_module(module), runner)(args)
    except Exception as e:  # noqa: BLE001 - sorted below: the user's mistake in one line, anything else raised
        if args.debug or not isinstance(e, _user_error_types(user_errors)):
            raise
        sys.stderr.write(f"kimiserve {args.command}: error: {e}\n")
        return 2
