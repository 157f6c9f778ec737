"""`sltune`: the command line. Each command lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import difflib
import sys
import traceback
from typing import NoReturn, Sequence

from pydantic import ValidationError

from sltune.cli import calibrate, profile, service, train, tune
from sltune.field_errors import one_line
from sltune.service.client import ServiceError

COMMANDS = [train, profile, tune, calibrate, service]
DEBUG_HELP = "show the full traceback of an error instead of one line"


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's default after its help, unless the help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: {str(action.default).replace('%', '%%')})".lstrip()


class Parser(argparse.ArgumentParser):
    """argparse, with its mistakes in one line and against the command they were made in: argparse prints the
    whole usage (two dozen lines for `train`) before its message, and reports a flag the command does not have
    against the top-level parser, with its usage and no hint. `-h` still prints the full help."""

    def error(self, message: str) -> NoReturn:
        self.fail(f"{message}; see `{self.prog} -h`")

    def fail(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args: Sequence[str] | None = None,                    # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """The top-level parse: what no parser took is reported by the command's parser, naming the flag it
        has that is closest; no command at all is named as such."""
        parsed, unknown = self.parse_known_args(args, namespace)
        sub = subcommands(self)
        command = sub.choices.get(getattr(parsed, "command", None) or "") if sub else None
        if unknown:
            (command or self).unrecognized(unknown)
        if sub and command is None:
            self.error(f"give a command: {', '.join(sub.choices)}")
        return parsed

    def unrecognized(self, unknown: list[str]) -> NoReturn:
        """`unrecognized argument --batch-size; did you mean --sub-batch-size?`: the flags among `unknown` (the
        values after them are theirs), or the stray values when there is no flag."""
        flags = [a.split("=", 1)[0] for a in unknown if a.startswith("-") and len(a) > 1] or unknown
        if len(flags) == 1 and (match := closest_flag(flags[0], self)):
            self.fail(f"unrecognized argument {flags[0]}; did you mean {match}?")
        self.error(f"unrecognized argument{'s' if len(flags) > 1 else ''} {', '.join(flags)}")


def closest_flag(given: str, parser: argparse.ArgumentParser) -> str | None:
    """The parser's long flag the user most likely meant: among those whose name holds the given one
    (--batch-size in --sub-batch-size, --memory in --device-memory-limit), else among all, the closest in
    spelling (difflib); none when nothing is close."""
    names = {o[2:]: o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings
             if o.startswith("--")}                 # compared without the dashes every flag shares
    name = given.lstrip("-")
    holding = [n for n in names if len(name) >= 3 and name in n]
    match = difflib.get_close_matches(name, holding or list(names), n=1, cutoff=0 if holding else 0.6)
    return names[match[0]] if match else None


def subcommands(p: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="sltune", formatter_class=HelpFormatter, description="SpeedLoader runtime, profiling and tuning")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # not required here: Parser.parse_args names the commands when none is given
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
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
        _end_progress_bars()
        if args.debug:
            traceback.print_exc()
        print(f"sltune {args.command}: error: {error_line(err)}", file=sys.stderr)
        return 2 if isinstance(err, USER_ERRORS) else 1


USER_ERRORS = (ValueError, OSError, ServiceError)


def error_line(err: Exception) -> str:
    """A user's mistake (a bad value, a missing file, a server's refusal) reads as its message; anything
    else is named as unexpected, with the way to see more."""
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.filename}: {err.strerror or err}"
    if isinstance(err, ValidationError):            # a model built from flags: the field and pydantic's reason
        return one_line(err)
    text = " ".join(str(err).split())
    if isinstance(err, USER_ERRORS):
        return text
    return f"{type(err).__name__}: {text} (unexpected; rerun with --debug for the traceback)"


def _end_progress_bars() -> None:
    """Close the progress bars an error interrupted (`tune`'s, when its database cannot be opened), so the error
    is a line of its own rather than the tail of the bar's, with the bar's last frame after it."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or ()):
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
