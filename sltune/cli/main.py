"""`sltune`: the command line. Each command lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import sys
import traceback

from pydantic import ValidationError

from sltune.cli import profile, service, train, tune
from sltune.service.client import ServiceError

COMMANDS = [train, profile, tune, service]
DEBUG_HELP = "show the full traceback of an error instead of one line"


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's default after its help, unless the help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: {str(action.default).replace('%', '%%')})".lstrip()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sltune", formatter_class=HelpFormatter,
                                description="SpeedLoader runtime, profiling and tuning")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    for command_parser in sub.choices.values():
        command_parser.formatter_class = HelpFormatter
        # SUPPRESS: a subcommand that is not given --debug keeps what `sltune --debug CMD` set
        command_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except KeyboardInterrupt:
        print(f"sltune {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the user sees one line; --debug shows the traceback
        if args.debug:
            traceback.print_exc()
        print(f"sltune {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2 if isinstance(err, USER_ERRORS) else 1


USER_ERRORS = (ValueError, OSError, ServiceError)


def _one_line(err: Exception) -> str:
    """A user's mistake (a bad value, a missing file, a server's refusal) reads as its message; anything
    else is named as unexpected, with the way to see more."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror or err}"
    if isinstance(err, ValidationError):            # a model built from flags: the field and pydantic's reason
        return "; ".join(_field_error(e) for e in err.errors())
    text = " ".join(str(err).split())
    if isinstance(err, USER_ERRORS):
        return text
    return f"{type(err).__name__}: {text} (unexpected; rerun with --debug for the traceback)"


def _field_error(e: dict) -> str:
    where = ".".join(str(p) for p in e["loc"])
    return f"{where}: {e['msg'].removeprefix('Value error, ').removeprefix(f'{where}: ')}"


if __name__ == "__main__":
    sys.exit(main())
