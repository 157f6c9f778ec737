"""Flags several commands share: the model and the SpeedLoader knobs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sltune.cli.flags import add_fields, given, reword
from sltune.config import RuntimeKnobs, SpeedLoaderConfig
from sltune.settings import Settings

DISK_VERSIONS_ALONE = ("--disk-versions: it counts the versions of --optimizer-offload disk's files; add "
                       "--optimizer-offload disk (or drop --disk-versions)")
OFFLOAD_DIR_ALONE = ("--offload-dir: the optimizer's files go there under --optimizer-offload disk (the weights' under "
                     "--param-offload disk); add --optimizer-offload disk (or drop --offload-dir)")
# the runtime's knobs `train` takes as flags, each declared once in RuntimeKnobs (--world-size is train's own: the
# ranks to run on)
KNOBS = tuple(name for name in RuntimeKnobs.model_fields if name != "world_size")


DB_HELP = ("where jobs are stored: a SQLAlchemy URL such as sqlite:///jobs.db or postgresql://user@host/db "
           "(default: $SLTUNE_DB, else sltune.db in the data directory: $SLTUNE_DATA_DIR or ./sltune-data)")
DATA_DIR_HELP = ("directory of the default SQLite database (sltune.db) and of trial artifacts such as traces "
                 "(default: $SLTUNE_DATA_DIR, else ./sltune-data)")
JOB_ID_HELP = "a job's id, as `tune`, `submit` and the dashboard show it"
SERVER_HELP = "the sltune server's URL, e.g. http://127.0.0.1:8000"


def add_knobs(parser: argparse.ArgumentParser) -> None:
    """The runtime's knobs as flags (sltune.cli.flags), over a --config file's values."""
    add_fields(parser, SpeedLoaderConfig, KNOBS, default="the --config file's, else {}")


def as_flags(text: str) -> str:
    """A refusal worded with the config's fields, worded with `train`'s flags instead: 'param_offload disk' reads
    '--param-offload disk' (sltune.cli.flags.reword)."""
    return reword(text, SpeedLoaderConfig, KNOBS)


def unused_flags(given: dict[str, Any], values: dict[str, Any]) -> None:
    """--offload-dir or --disk-versions given where nothing reads them: one line naming the flag that would (a
    mistake the config would keep quietly). `values`: the knobs as they will run."""
    if values.get("backend", "speedloader") != "speedloader":   # another backend's own check names its use
        if "disk_versions" in given:
            raise ValueError(DISK_VERSIONS_ALONE)
        return
    if "offload_dir" in given and values.get("optimizer_offload", "host") == "host" and \
            values.get("param_offload", "host") == "host":
        raise ValueError(OFFLOAD_DIR_ALONE)
    if "disk_versions" in given and values.get("optimizer_offload", "host") == "host":
        raise ValueError(DISK_VERSIONS_ALONE)


def config_from_args(args: argparse.Namespace, base: SpeedLoaderConfig | None = None) -> SpeedLoaderConfig:
    """The config file (if any) with flags given on the command line taking precedence. The file was checked
    when it was read, so a bad value here came from a flag: the message names the flag."""
    data: dict[str, Any] = base.model_dump() if base is not None else {}
    flags = given(args, KNOBS)
    data.update(flags)
    unused_flags(flags, data)
    try:
        return SpeedLoaderConfig.from_dict(data, source="command line")
    except ValueError as err:
        raise ValueError(as_flags(str(err).removeprefix("command line: "))) from None


def fail(message: str, code: int = 2) -> None:
    print(f"sltune: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def open_store(settings: Settings) -> None:
    """A database that cannot be opened (missing, unreachable, not one) is one line before anything starts: the
    store (sltune.store.db) says what to create, start or fix, and keeps its engine for the process's own use."""
    from sltune.store import Store

    Store(settings.db_url())
