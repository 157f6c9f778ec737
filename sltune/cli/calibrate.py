"""`sltune calibrate [SPEC]`: this machine's rates, measured once and kept in the job store per machine and workload
(sltune.machine); shown again from the store until they are a month old or `--again` asks."""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING

from sltune.cli.common import DB_HELP, open_store

if TYPE_CHECKING:
    from sltune.machine import MachineRates


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's rates (matmuls, copies, disk, optimizer)",
                       description="Time the work a training step is made of on this machine: matmuls and attention "
                                   "at a model's own shapes and dtype (a spec's model and search; without SPEC "
                                   "llama-small in float32), elementwise and norm work, torch's AdamW per element, "
                                   "host-device copies and O_DIRECT disk reads and writes, the cost of one op. Each "
                                   "is a median with its slowest and fastest sample. Kept in the job store for this "
                                   "machine and workload and shown from there until a month old.")
    p.add_argument("spec", nargs="?", help="a tuning spec YAML: measure at its model's shapes, dtype, device and "
                                           "sub-batch rows")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--offload-dir", help="time the disk in this folder, where trials and training offload to "
                                         "(default: where `tune` offloads: the data directory's offload/)")
    p.add_argument("--ranks", type=int, nargs="+", metavar="N",
                   help="time all-gather and reduce-scatter over N ranks on this machine (default: the spec's "
                        "hardware.world_size when above 1, else none)")
    p.add_argument("--again", action="store_true", help="measure even if the store holds fresh rates")
    p.add_argument("--budget", type=float, default=60.0,
                   help="about how many seconds the measurements take (each probe runs a warm-up and 3 samples at "
                        "least)")
    p.add_argument("--out", help="also write the rates here as JSON")
    p.add_argument("--json", action="store_true", help="print the rates as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sltune.machine import Fingerprint
    from sltune.runtime.disk.direct_io import writable_dir
    from sltune.settings import Settings
    from sltune.store import Store
    from sltune.tuning.cost.stored_rates import calibrated, collective_ranks
    from sltune.tuning.spec import MAX_WORLD_SIZE, TuningSpec

    if not (math.isfinite(args.budget) and args.budget > 0):
        raise ValueError(f"--budget must be a positive number of seconds, got {args.budget:g}")
    settings = Settings(db=args.db) if args.db else Settings()
    open_store(settings)
    spec = TuningSpec.load(args.spec) if args.spec else None
    ranks = collective_ranks(spec, args.ranks)
    if ranks and not 2 <= ranks[0] <= ranks[-1] <= MAX_WORLD_SIZE:
        raise ValueError(f"--ranks: collectives need 2 to {MAX_WORLD_SIZE} ranks, got {' '.join(map(str, ranks))}")
    folder = writable_dir(args.offload_dir or settings.offload_root(), "--offload-dir")
    device = spec.hardware.device if spec else "cpu"
    if device.startswith("cuda") and ranks:
        import torch

        if ranks[-1] > torch.cuda.device_count():
            raise ValueError(f"--ranks {ranks[-1]}: the collectives take a GPU per rank on {device}, and this machine "
                             f"has {torch.cuda.device_count()}; give --ranks at most that")
    rates, measured = calibrated(Store(settings.db_url()), spec, folder, budget_s=args.budget, ranks=ranks,
                                 again=args.again,
                                 progress=lambda what: print(f"calibrate: {what}...", file=sys.stderr, flush=True))
    note = (f"measured in {rates.seconds:.1f}s, stored for machine {Fingerprint.here().key}" if measured else
            f"stored {rates.measured_at:%Y-%m-%d %H:%M} UTC (--again measures again)")
    if args.out:
        rates.save(args.out)
    print(rates.model_dump_json(indent=1) if args.json else describe(rates, note))
    return 0


def describe(r: MachineRates, note: str) -> str:
    """The rates as a table: each median with its [slowest, fastest] sample."""
    return "\n".join([r.where(), f"  {note}", *(f"  {what}: {median} [{low}, {high}] {unit}"
                                                 for what, median, low, high, unit, _ in r.shown())])
