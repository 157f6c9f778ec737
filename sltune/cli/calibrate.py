"""`sltune calibrate [SPEC]`: this machine's rates, measured once and kept in the job store per machine and workload
(sltune.machine); shown again from the store until they are a month old or `--again` asks."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timedelta, timezone

from sltune.cli.common import DB_HELP, open_store
from sltune.sizes import format_bytes

STALE_AFTER = timedelta(days=30)     # a driver, BIOS or kernel update moves rates without changing the fingerprint


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
                                         "(default: the system's temporary folder)")
    p.add_argument("--again", action="store_true", help="measure even if the store holds fresh rates")
    p.add_argument("--budget", type=float, default=60.0, help="seconds the measurements may take at most")
    p.add_argument("--out", help="also write the rates here as JSON (what `sltune plan --machine FILE` reads)")
    p.add_argument("--json", action="store_true", help="print the rates as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from sltune.machine import Fingerprint, MachineRates, Workload, calibrate
    from sltune.settings import Settings
    from sltune.store import Store

    if args.budget <= 0:
        raise ValueError(f"--budget must be positive seconds, got {args.budget:g}")
    settings = Settings(db=args.db) if args.db else Settings()
    open_store(settings)
    workload, device = Workload(), "cpu"
    if args.spec:
        from sltune.tuning.cost.workload import workload_of
        from sltune.tuning.spec import TuningSpec

        spec = TuningSpec.load(args.spec)
        workload, device = workload_of(spec), spec.hardware.device
    store = Store(settings.db_url())
    machine = Fingerprint.here()
    stored = None if args.again else store.latest_rates(machine.key, workload.key)
    if stored is not None and datetime.now(timezone.utc) - stored.measured_at < STALE_AFTER:
        rates = MachineRates.model_validate(stored.rates)
        note = f"stored {rates.measured_at:%Y-%m-%d %H:%M} UTC (--again measures again)"
    else:
        rates = calibrate(workload, device, args.budget, args.offload_dir,
                          progress=lambda what: print(f"calibrate: {what}...", file=sys.stderr, flush=True))
        store.save_rates(machine.key, workload.key, rates.model_dump(mode="json"))
        note = f"measured in {rates.seconds:.1f}s, stored for machine {machine.key}"
    if args.out:
        rates.save(args.out)
    print(rates.model_dump_json(indent=1) if args.json else describe(rates, note))
    return 0


def describe(r, note: str) -> str:
    """The rates as a table: each median with its [slowest, fastest] sample."""
    def span(rate, scale: float, unit: str) -> str:
        return f"{rate.median / scale:,.2f} [{rate.low / scale:,.2f}, {rate.high / scale:,.2f}] {unit}"

    fp = r.fingerprint
    lines = [f"{fp.cpu}, {fp.cores} cores, {format_bytes(fp.memory_bytes)}"
             + (f", {', '.join(fp.gpus)}" if fp.gpus else "") + f", torch {fp.torch}; {r.device}, {r.threads} threads",
             f"  {note}"]
    for m in r.matmul:
        lines.append(f"  matmul {m.rows}x{m.k} @ {m.k}x{m.n} {m.dtype}: {span(m.flops, 1e9, 'GFLOP/s')}")
    for a in r.attention:
        lines.append(f"  attention b={a.batch} h={a.heads} s={a.seq} d={a.head_dim} {a.dtype}: "
                     f"{span(a.flops, 1e9, 'GFLOP/s')}")
    for dtype, rate in r.elementwise.items():
        lines.append(f"  elementwise {dtype}: {span(rate, 1e9, 'G elements/s')}")
    for dtype, rate in r.norm.items():
        lines.append(f"  rms_norm {dtype}: {span(rate, 1e9, 'G elements/s')}")
    for name, rate in r.optimizer.items():
        lines.append(f"  optimizer {name}: {span(rate, 1e6, 'M parameters/s')}")
    for name, rate in r.copies.items():
        lines.append(f"  copy {name}: {span(rate, 2**30, 'GiB/s')}")
    for name, rate in r.disk.items():
        lines.append(f"  disk {name}{' (O_DIRECT)' if r.disk_direct else ''}: {span(rate, 2**30, 'GiB/s')}")
    if r.op_overhead:
        lines.append(f"  one op: {1e6 / r.op_overhead.median:.1f} us [{1e6 / r.op_overhead.high:.1f}, "
                     f"{1e6 / r.op_overhead.low:.1f}]")
    return "\n".join(lines)
