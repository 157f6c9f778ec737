"""`sltune`: the command line. Each command lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import sys

from sltune.cli import profile, service, train, tune

COMMANDS = [train, profile, tune, service]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sltune", description="SpeedLoader runtime, profiling and tuning")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as err:
        print(f"sltune {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sltune {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
