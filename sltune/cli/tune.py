"""`sltune tune`, `sltune export` and `sltune plan`: tuning jobs without a server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sltune.backends.export import FORMATS
from sltune.backend_knobs import BACKENDS
from sltune.cli import flags
from sltune.cli.common import DB_HELP, JOB_ID_HELP, SERVER_HELP, open_store
from sltune.cli.progress import JobBar, describe_config
from sltune.config import RuntimeKnobs
from sltune.profiling import forks
from sltune.settings import Settings
from sltune.sizes import format_bytes, parse_bytes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="run a tuning job here (resumes an unfinished one with the same spec)",
                       description="Search sub-batch size, effective batch and live blocks for the fastest config "
                                   "that fits the spec's memory limits. Re-running the same command with the same "
                                   "--db resumes an interrupted job without repeating finished trials.")
    p.add_argument("spec", help="tuning spec YAML (examples/tiny-llama-cpu.yaml; every field: docs/reference/spec.md)")
    p.add_argument("--out", help="write the best config YAML here; `sltune train --config FILE` trains with it")
    p.add_argument("--strategy", choices=["oneshot", "grid", "random", "tpe"],
                   help="override search.strategy (default: the spec's)")
    p.add_argument("--db", help=DB_HELP)
    p.add_argument("--job-id", help="resume (or name) this job (default: the unfinished job with the same spec, "
                                    "else a new one)")
    p.add_argument("--json", action="store_true", help="print the job result as JSON instead of a progress bar and "
                                                       "text")
    p.add_argument("--oversubscribe", action="store_true",
                   help="run hardware.world_size ranks even beyond this machine's cores (refused otherwise: the ranks "
                        "would take turns on the cores, and the trials would measure that)")
    p.set_defaults(run=run_tune)

    e = sub.add_parser("export", help="write the best config of a finished job as YAML (or its backend's own "
                                      "format)",
                       description="Write the best config of a succeeded job as the best.yaml `sltune train "
                                   "--config` reads, from a server (--server) or straight from the job database "
                                   "(--db; the default database when neither is given). A job that searched several "
                                   "backends has a pick of each (--backend); a deepspeed pick also exports as "
                                   "DeepSpeed's JSON config, an fsdp pick as accelerate's config YAML (--format).")
    e.add_argument("job_id", help=JOB_ID_HELP)
    where = e.add_mutually_exclusive_group()
    where.add_argument("--server", help=SERVER_HELP)
    where.add_argument("--db", help=DB_HELP)
    e.add_argument("--out", help="file to write (default: print it)")
    e.add_argument("--backend", choices=BACKENDS, help="that backend's pick (default: the overall best, whichever "
                                                       "backend it is)")
    e.add_argument("--format", dest="fmt", choices=FORMATS, default="yaml",
                   help="yaml: the best.yaml `sltune train --config` reads (any pick); ds_config: the JSON "
                        "deepspeed.initialize(config=...) reads (a deepspeed pick); accelerate: the YAML `accelerate "
                        "launch --config_file` reads, FSDP2 (an fsdp pick)")
    e.set_defaults(run=run_export)

    pl = sub.add_parser("plan", help="predict peaks before any trial (a spec), or the best config under other "
                                      "memory limits (a best.yaml)",
                        description="Given a tuning spec: every config's host and device peaks predicted from the "
                                    "model's shape before any trial, which fit the spec's limits (or, with none, "
                                    "this machine's trial ceiling), and the limit that binds the largest; a spec "
                                    "none of whose configs fits is refused term by term, with what would fit "
                                    "(exit code 1). Given a best.yaml: the fastest config under other memory limits "
                                    "from the fitted models it carries, and how far to trust that (leave-one-out "
                                    "errors, knobs beyond the measured range). No trial runs either way.")
    pl.add_argument("source", nargs="?", help="a tuning spec YAML, or a best-config YAML exported by a job (told "
                                              "apart by their content)")
    pl.add_argument("--from", dest="from_file", metavar="FILE", help="the same as SOURCE")
    pl.add_argument("--device-memory-limit", help="bytes or e.g. 24GiB (default: the file's limit)")
    pl.add_argument("--host-memory-limit", help="bytes or e.g. 64GiB (default: the file's limit; a spec without "
                                                "one: this machine's trial ceiling)")
    pl.add_argument("--disk-limit", help="a spec that sweeps search.optimizer_offload or search.param_offload disk: "
                                         "bytes or e.g. 200GiB, a what-if that stands whatever this machine has free "
                                         "(its free space is said beside it) (default: the spec's "
                                         "hardware.disk_limit, else the free space where trials offload to)")
    flags.add_fields(pl, RuntimeKnobs, ["disk_versions"], notes={
        "disk_versions": ". A spec: the files as `sltune train --disk-versions` keeps them (the tuner does not search "
                         "it)"})
    pl.add_argument("--json", action="store_true", help="print the prediction as JSON")
    pl.add_argument("--machine", metavar="RATES.json",
                    help="a spec: predict step times from these rates (`sltune calibrate SPEC --out RATES.json`, "
                         "on this machine or another: a what-if of that machine) (default: the rates `sltune "
                         "calibrate SPEC` stored for this machine in --db, if any)")
    pl.add_argument("--db", help=DB_HELP + " (a spec: where to find this machine's rates)")
    pl.set_defaults(run=run_plan)


def run_tune(args: argparse.Namespace) -> int:
    from sltune.tuning.report.result import export_yaml
    from sltune.service.local import fits_this_machine, tune
    from sltune.settings import Settings
    from sltune.tuning.cost.admission import admitted
    from sltune.tuning.spec import TuningSpec

    spec = TuningSpec.load(args.spec)
    if args.strategy:
        spec = TuningSpec.model_validate({**spec.model_dump(), "search": {**spec.search.model_dump(),
                                                                          "strategy": args.strategy}})
    ok = admitted(spec, args.spec)           # its model's shape against its limits: a refusal is one line
    # a database it cannot open is one line before the fork server starts; a refused spec stored nothing
    open_store(Settings(db=args.db) if args.db else Settings())
    # the trials' fork server imports torch and transformers beside this process from here: a spec the schema
    # refused (its limits below what its least config needs included) answered without it
    forks.start()
    fits_this_machine(ok, Settings(), args.oversubscribe)       # a refusal is one line, before the bar starts
    bar = JobBar(f"tune {spec.name} ({spec.search.strategy})", spec.search.max_trials, disable=args.json)
    result = tune(ok, args.db, job_id=args.job_id, progress=bar.show, oversubscribe=args.oversubscribe)
    bar.close()
    if args.out and result["best"]:
        export_yaml(spec, result, args.out)
    if args.json:
        print(json.dumps(result))
    else:
        print(describe(result, args.out, spec.workload.mode))
    return 0 if result["status"] == "succeeded" else 1


def describe(r: dict, out: str | None = None, mode: str = "train") -> str:
    confirms = sum(t["role"] == "confirm" for t in r["trials"])
    lines = [f"job {r['job_id']} {r['status']}: {len(r['trials']) - confirms} search + {confirms} confirm trials of "
             f"{r['space_size']} configs in {r['wall_seconds']:.0f}s ({r['stop_reason']})"]
    if r.get("error"):
        lines.append(f"  {r['error']}")
    if r["best"]:
        b, p = r["best"], r["predicted"] or {}
        c = b["config"]
        ci = b.get("tokens_per_s_ci95")
        ci_text = f" [{ci[0]:,.1f}, {ci[1]:,.1f}]" if ci else ""
        lines.append(f"  best: {describe_config(c)}: {b['tokens_per_s']:,.1f}{ci_text} tokens/s measured"
                     + (f" (the median of its {len(b['from_trials'])} trials)" if len(b.get("from_trials") or []) > 1
                        else ""))
        if r.get("confidence"):
            lines.append(f"  confidence: {r['confidence']}")
        lines.append(f"  peaks: device {format_bytes(b['peak_device_bytes'])} (predicted "
                     f"{format_bytes(p.get('peak_device_bytes'))}), host {format_bytes(b['peak_host_bytes'])} "
                     f"(predicted {format_bytes(p.get('peak_host_bytes'))})"
                     + (f", disk {format_bytes(p['peak_disk_bytes'])} predicted" if p.get("peak_disk_bytes") else "")
                     + f"; binding limit: {r['binding_limit']}")
    for kind, m in r["models"].items():
        r2 = f"{m['r2']:.3f}" if m.get("r2") is not None else "-"
        deep = m.get("full_depth_error")
        beside = (f"; the probes' fit at full depth: {deep['typical']:.1%} typical, {deep['max']:.1%} max over "
                  f"{deep['n']} full-depth trials" if deep else "")
        lines.append(f"  model {kind}: {m['n']} points, R^2 {r2}, {_loo(m)}" + beside)
    depth = r.get("depth")
    if depth:
        from sltune.tuning.search.state import AUTO_STEP_S

        ran, layers = ", ".join(map(str, depth["probes_ran_at"])), depth["layers"]
        step = depth.get("first_probe_full_depth_step_s")
        if not ran:
            said = f"every trial ran the whole model ({layers} layers)"
        elif depth.get("reduced", True):
            said = (f"probes ran at {ran} of the model's {layers} layers, frontier and confirmation trials at all "
                    f"{layers}")
        else:       # auto, after its first probe
            said = (f"the first probe, at {ran} layers, put a whole-model step at {step:.2f}s at most (under "
                    f"{AUTO_STEP_S}s): the other trials ran all {layers} layers, and it stayed out of the fits")
        lines.append(f"  probe_layers {depth['probe_layers']}: {said}")
    if out and r["best"]:
        disk = " --offload-dir DIR" if "disk" in (r["best"]["config"].get("optimizer_offload"),
                                                   r["best"]["config"].get("param_offload")) else ""
        use = (f"train with `sltune train --config {out}{disk}`" if mode == "train" else
               "generate with SpeedLoaderEngine(model, SpeedLoaderConfig.from_yaml(path)).generate(...)")
        lines.append(f"  wrote {out}: {use}")
    return "\n".join(lines)


def run_export(args: argparse.Namespace) -> int:
    from sltune.store import Store
    from sltune.tuning.spec import TuningSpec

    if args.server:
        from sltune.service.client import Client

        # yaml of the overall best: the plain request, which servers from before backends answer too
        text = Client(args.server).config_yaml(args.job_id, args.backend, None if args.fmt == "yaml" else args.fmt)
        if args.out:
            Path(args.out).write_text(text)
        else:
            print(text, end="")
        return 0
    store = Store(args.db or Settings().db_url())
    job = store.job(args.job_id)
    if job is None:
        raise ValueError(f"no job {args.job_id!r} in {store.url}")
    if job.status != "succeeded":
        raise ValueError(f"job {job.id} is {job.status}; only a succeeded job has a best config")
    from sltune.tuning.report.formats import export_config

    text, _ = export_config(TuningSpec.model_validate(job.spec), job.result, args.backend, args.fmt)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0


def _pct(x: float | None) -> str:
    return f"{x:.1%}" if x is not None else "-"


def _loo(m: dict) -> str:
    """'leave-one-out error 3.1% typical, 7.9% max', or why the fit has none
    (sltune.tuning.search.fit.no_loo_reason)."""
    from sltune.tuning.search.fit import no_loo_reason

    why = no_loo_reason(m)
    if why:
        return f"no leave-one-out error: {why}"
    return f"leave-one-out error {_pct(m.get('loo_typical_error'))} typical, {_pct(m['loo_rel_error'])} max"


def _loo_errors(loo: dict[str, dict]) -> str:
    """'device 2.1% typical, 4.0% max; none for host and throughput: too few points ...': each model's errors, and
    once for the models that share it, why some have none."""
    without: dict[str, list[str]] = {}
    for kind, e in loo.items():
        if e.get("missing"):
            without.setdefault(e["missing"], []).append(kind)
    shown = [f"{kind} {_pct(e['typical'])} typical, {_pct(e['max'])} max" for kind, e in loo.items()
             if not e.get("missing")]
    shown += [f"none for {', '.join(kinds[:-1]) + ' and ' if kinds[:-1] else ''}{kinds[-1]}: {why}"
              for why, kinds in without.items()]
    return "; ".join(shown)


def run_plan(args: argparse.Namespace) -> int:
    from sltune.tuning.report.compare import config_name
    from sltune.tuning.report.plan_from_fits import plan
    from sltune.tuning.report.plan_from_prior import is_spec
    from sltune.yamlfile import read_yaml

    if args.source and args.from_file and args.source != args.from_file:
        raise ValueError("give the file once: SOURCE or --from FILE, not both")
    source = args.source or args.from_file
    if not source:
        raise ValueError("plan needs a file: a tuning spec (sltune plan SPEC.yaml) or a best.yaml a job exported")
    limits = [None if value is None else parse_bytes(value, flag) for value, flag in (
        (args.device_memory_limit, "--device-memory-limit"), (args.host_memory_limit, "--host-memory-limit"))]
    data = read_yaml(source)
    if is_spec(data):
        disk = None if args.disk_limit is None else parse_bytes(args.disk_limit, "--disk-limit")
        return _plan_spec(data, source, limits, args.json, disk, args.disk_versions, _rates(args, data, source))
    for flag, value, what in (("--disk-limit", args.disk_limit, "without disk"),
                              ("--disk-versions", args.disk_versions, "without disk"),
                              ("--machine", args.machine, "measured here, not from a machine's rates")):
        if value is not None:
            raise ValueError(f"{flag}: {source} is a best.yaml, whose plan predicts from its fitted models {what}; "
                             f"give the tuning spec (sltune plan SPEC.yaml {flag} ...)")
    r = plan(source, *limits)
    if args.json:
        print(json.dumps(r))
        return 0 if r["best"] else 1
    lim = r["limits"]
    print(f"limits: device {format_bytes(lim['device_memory_limit'])}, host {format_bytes(lim['host_memory_limit'])}: "
          f"{r['fitting']} of {r['candidates']} configs predicted to fit")
    print(f"  leave-one-out errors of the models: {_loo_errors(r['leave_one_out_error'])}")
    if r["unpredictable"]:
        print(f"  {len(r['unpredictable'])} fitting configs have no throughput prediction (listed, not ranked):")
        for u in r["unpredictable"]:
            print(f"    {config_name(u['config'])}: {u['reason']}")
    if not r["best"]:
        print(f"  {r['message']}")
        return 1
    c, p = r["best"]["config"], r["best"]["predicted"]
    never = "" if r["best"]["measured"] else " [never measured]"
    print(f"  best{never}: {config_name(c)}: "
          f"{p['tokens_per_s']:,.1f} tokens/s predicted; device {format_bytes(p['peak_device_bytes'])}, "
          f"host {format_bytes(p['peak_host_bytes'])}; binding limit: {r['best']['binding_limit']}")
    print(f"  confidence: {r['confidence']['summary']}")
    beyond = sum(1 for x in r["configs"] if x["extrapolated"])
    if beyond:
        print(f"  {beyond} of the {len(r['configs'])} ranked configs extrapolate beyond the measured ranges "
              "(marked in --json)")
    m = r["measured_best"]
    print(f"  (the job measured {m['tokens_per_s']:,.1f} tokens/s at {config_name(m['config'])})")
    return 0


def _rates(args: argparse.Namespace, data: dict, source: str) -> tuple[Any, str | None]:
    """The rates a spec's plan predicts step times from, and where they came from: --machine's file, else what
    `sltune calibrate SPEC` stored for this machine (none: (None, None))."""
    from sltune.machine.rates import MachineRates

    if args.machine:
        return MachineRates.load(args.machine), f"{args.machine} (a prediction from given rates)"
    from sltune.tuning.cost.stored_rates import stored_rates
    from sltune.settings import Settings
    from sltune.store import Store
    from sltune.tuning.spec import TuningSpec

    settings = Settings(db=args.db) if args.db else Settings()
    try:
        open_store(settings)
        rates = stored_rates(Store(settings.db_url()), TuningSpec.parse(data, str(source)))
    except Exception as err:        # a plan needs no store: the peaks stand without step times
        if args.db:
            raise
        print(f"plan: no step times: the job store could not be read ({str(err).splitlines()[0]})", file=sys.stderr)
        return None, None
    return (rates, f"this machine's rates, calibrated {rates.measured_at:%Y-%m-%d %H:%M} UTC") if rates else (None, None)


def _plan_spec(data: dict, source: str, limits: list, as_json: bool, disk_limit: int | None = None,
               disk_versions: int | None = None, rates: tuple[Any, str | None] = (None, None)) -> int:
    """Every config of a spec with its predicted peaks (and step times, given rates); the refusal when none fits
    (exit code 1)."""
    from sltune.tuning.report.plan_from_prior import plan_spec
    from sltune.tuning.search.state import CHEAPER_STEP

    r = plan_spec(data, source, *limits, disk_limit=disk_limit, disk_flag="--disk-limit", disk_versions=disk_versions,
                  rates=rates[0], rates_from=rates[1])
    if as_json:
        print(json.dumps(r))
        return 0 if r["fitting"] else 1
    lim = r["limits"]
    # a disk limit larger than the free space: 'hardware.disk_limit is 1.0 TiB but only 80.0 GiB is free in DIR: ...'
    disk = (f", disk {format_bytes(lim['disk_limit'])} ({lim.get('disk_limit_note') or lim['disk_limit_from']})"
            if lim.get("disk_limit_from") else "")
    disk += ", the disk tier's files in one version (--disk-versions 1)" if disk and r["disk_versions"] == 1 else ""
    print(f"{r['model']}: {r['fitting']} of {r['candidates']} configs predicted to fit device "
          f"{format_bytes(lim['device_memory_limit'])}, host {format_bytes(lim['host_memory_limit'])} "
          f"({lim['host_limit_from']}){disk} with the {r['margin']:.0%} margin; no trial ran")
    print(f"  host peaks include {format_bytes(r['trial_baseline_bytes'])} a trial process holds before its model "
          "(as tune or profile last measured it here)")
    print(f"  step times predicted from {r['rates']['from']}: {r['rates']['machine']}" if r["rates"] else
          "  no step times: no rates for this spec's shapes on this machine (sltune calibrate SPEC stores them; "
          "--machine RATES.json reads another's)")
    if r["rates"] and r["rates"]["missing"]:
        print(f"  some configs have no step time: {r['rates']['missing']}")
    for row in r["configs"]:
        verdict = "fits" if row["fits"] else "over " + "+".join(row["over"])
        on_disk = f", disk {format_bytes(row.get('peak_disk_bytes') or 0)}" if disk else ""
        print(f"  {describe_config(row['config'])}: host {format_bytes(row['peak_host_bytes'])}, device "
              f"{format_bytes(row['peak_device_bytes'])}{on_disk}{_speed(row) if r['rates'] else ''}  {verdict}")
    shown: dict[str, int] = {}          # the five largest of each backend: a union's ties would hide the others
    for big in r["largest"]:
        backend = big["config"].get("backend") or "speedloader"
        shown[backend] = shown.get(backend, 0) + 1
        if shown[backend] > 5:
            continue
        p = big["prior"]
        on_disk = f", disk {format_bytes(p.get('peak_disk_bytes') or 0)}" if disk else ""
        moved = (f"; disk traffic a step {format_bytes(p['disk_read_bytes_per_step'])} read, "
                 f"{format_bytes(p['disk_write_bytes_per_step'])} written (predicted)"
                 if p.get("disk_read_bytes_per_step") else "")
        print(f"  largest that fits: {describe_config(big['config'])} (host {format_bytes(p['peak_host_bytes'])}, "
              f"device {format_bytes(p['peak_device_bytes'])}{on_disk}{moved}); binding limit: "
              f"{big['binding_limit']}")
    if r["pick"]:
        among = "" if all(row["predicted_step_s"] is not None for row in r["configs"] if row["fits"]) else \
            " among those with a step time"
        print(f"  pick (predicted fastest that fits{among}): {describe_config(r['pick']['config'])}"
              f"{_speed(r['pick'])}; binding limit: {r['pick']['binding_limit']}")
    if r["too_slow"]:
        timeout = f"search.trial_timeout_s {r['trial_timeout_s']:g}s"
        print(f"  {r['too_slow']} of the {r['fitting']} configs that fit are predicted to outlast {timeout}: their "
              f"trials would time out, so the pick is among the others" if r["pick"] else
              f"  every config that fits is predicted to outlast {timeout}: a trial of any would time out, so there "
              f"is no pick; raise it, or make a step cheaper ({CHEAPER_STEP})")
    if r["refusal"]:
        print(f"  refused: {r['refusal']}")
    return 0 if r["fitting"] else 1


def _speed(row: dict) -> str:
    """', 1,234.5 tokens/s [1,100.0, 1,300.2] (compute 80%, memcpy 12%, ...)' predicted; '' where not modelled."""
    if row.get("predicted_tokens_per_s") is None:
        return ", no step time"
    lo, hi = row["predicted_tokens_per_s_interval"]
    shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(row["predicted_breakdown"].items(), key=lambda kv: -kv[1])
                       if v >= 0.005)
    return f", {row['predicted_tokens_per_s']:,.1f} tokens/s [{lo:,.1f}, {hi:,.1f}] ({shares})"
