"""Flags several commands share: the model and the SpeedLoader knobs."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from sltune.config import SpeedLoaderConfig
from sltune.settings import Settings

DISK_VERSIONS_ALONE = ("--disk-versions: it counts the versions of --optimizer-offload disk's files; add "
                       "--optimizer-offload disk (or drop --disk-versions)")
KNOB_FLAGS = {
    "sub_batch_size": ("--sub-batch-size", int, "rows per sub-batch (b)"),
    "num_sub_batches": ("--num-sub-batches", int, "sub-batches per step (N)"),
    "num_live_blocks": ("--num-live-blocks", int, "layers live on the device at once (k)"),
    "schedule": ("--schedule", str, "speedloader | canonical | resident"),
    "activations": ("--activations", str, "recompute | offload: how a group's backward gets its activations"),
    "device": ("--device", str, "cpu, cuda, cuda:1, ..."),
    "dtype": ("--dtype", str, "float32 | bfloat16 | float16"),
    "device_memory_limit": ("--device-memory-limit", str, "bytes or e.g. 2GiB"),
    "kv_cache": ("--kv-cache", str, "generation: KV caches in host | device memory"),
    "weights_on_device": ("--weights-on-device", float, "generation: the share of the parameter bytes kept on the "
                                                        "device for a whole generate call, 0 to 1"),
    "optimizer_offload": ("--optimizer-offload", str, "host | disk: where the float32 masters and the optimizer "
                                                      "state live; disk keeps them in files under --offload-dir"),
    "param_offload": ("--param-offload", str, "host | disk: where the dtype copy of the weights lives between loads; "
                                              "disk keeps a file per unit under --offload-dir, read ahead into a "
                                              "window (training: with --optimizer-offload disk)"),
    "offload_dir": ("--offload-dir", str, "the directory of --optimizer-offload/--param-offload disk's files, on a "
                                          "local disk"),
    "disk_versions": ("--disk-versions", int, "1 | 2: versions of --optimizer-offload disk's files a step keeps; 1 "
                                              "drops each old file as its new one lands (about half the disk), but a "
                                              "step that fails part-way cannot roll back: resume from the last "
                                              "checkpoint (--resume)"),
}


DB_HELP = ("where jobs are stored: a SQLAlchemy URL such as sqlite:///jobs.db or postgresql://user@host/db "
           "(default: $SLTUNE_DB, else sltune.db in the data directory: $SLTUNE_DATA_DIR or ./sltune-data)")
DATA_DIR_HELP = ("directory of the default SQLite database (sltune.db) and of trial artifacts such as traces "
                 "(default: $SLTUNE_DATA_DIR, else ./sltune-data)")
JOB_ID_HELP = "a job's id, as `tune`, `submit` and the dashboard show it"
SERVER_HELP = "the sltune server's URL, e.g. http://127.0.0.1:8000"


def add_knobs(parser: argparse.ArgumentParser) -> None:
    for field, (flag, typ, help_) in KNOB_FLAGS.items():
        default = SpeedLoaderConfig.model_fields[field].default
        parser.add_argument(flag, dest=field, type=typ, default=None,
                            help=f"{help_} (default: the --config file's, else "
                                 f"{'none' if default is None else default})")
    parser.add_argument("--no-mixed-precision", dest="mixed_precision", action="store_const", const=False,
                        default=None, help="with --dtype bfloat16/float16, keep one copy of the weights and the "
                        "optimizer state in that dtype instead of float32 masters (default: the --config file's, "
                        "else mixed precision)")


def as_flags(text: str, flags: dict[str, str] | None = None) -> str:
    """A refusal worded with the config's fields, worded with this command's flags instead: 'param_offload disk'
    reads '--param-offload disk' (`flags`: field -> flag; by default the knobs' whose names are no English word,
    such as param_offload: 'device' or 'schedule' in a sentence stays as it is)."""
    flags = flags or {field: spec[0] for field, spec in KNOB_FLAGS.items() if "_" in field}
    return re.sub(r"\b(" + "|".join(flags) + r")\b", lambda m: flags[m.group(1)], text)


def config_from_args(args: argparse.Namespace, base: SpeedLoaderConfig | None = None) -> SpeedLoaderConfig:
    """The config file (if any) with flags given on the command line taking precedence. The file was checked
    when it was read, so a bad value here came from a flag: the message names the flag."""
    data: dict[str, Any] = base.model_dump() if base is not None else {}
    given = {f: getattr(args, f) for f in (*KNOB_FLAGS, "mixed_precision") if getattr(args, f, None) is not None}
    data.update(given)
    if "offload_dir" in given and data.get("optimizer_offload", "host") == "host" and \
            data.get("param_offload", "host") == "host" and \
            data.get("backend", "speedloader") == "speedloader":     # another backend's own check names its use
        raise ValueError("--offload-dir: the optimizer's files go there under --optimizer-offload disk; add "
                         "--optimizer-offload disk (or drop --offload-dir)")
    if "disk_versions" in given and data.get("optimizer_offload", "host") == "host" and \
            data.get("backend", "speedloader") == "speedloader":
        raise ValueError(DISK_VERSIONS_ALONE)
    try:
        return SpeedLoaderConfig.from_dict(data, source="command line")
    except ValueError as err:
        message = str(err).removeprefix("command line: ")
        for field in given:
            flag = KNOB_FLAGS[field][0] if field in KNOB_FLAGS else "--no-mixed-precision"
            message = re.sub(rf"(^|; ){field}:", rf"\g<1>{flag}:", message)
        raise ValueError(message) from None


def fail(message: str, code: int = 2) -> None:
    print(f"sltune: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def open_store(settings: Settings) -> None:
    """A database that cannot be opened (missing, unreachable, not one) is one line before anything starts: the
    store (sltune.store.db) says what to create, start or fix, and keeps its engine for the process's own use."""
    from sltune.store import Store

    Store(settings.db_url())
