"""`sltune serve`, `worker`, `submit` and `compare`: the service and its CI client."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from sltune.cli.common import DATA_DIR_HELP, DB_HELP, SERVER_HELP, open_store
from sltune.cli.progress import JobBar, describe_config
from sltune.field_errors import one_line
from sltune.profiling import forks
from sltune.service.embedded import job_worker
from sltune.settings import Settings


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("serve", help="REST API + dashboard + one embedded worker (SQLite by default)",
                       description="Serve the REST API (/docs), the dashboards (/dashboard) and, unless "
                                   "--no-worker, one worker that runs the submitted jobs.",
                       epilog="environment: SLTUNE_API_TOKEN is the bearer token every write needs (without it "
                              "the server binds to loopback only); every other setting is an SLTUNE_* variable "
                              "too (SLTUNE_DB, SLTUNE_DATA_DIR, SLTUNE_MAX_TRIALS, ...: see sltune/settings.py). "
                              "SLTUNE_RAY_ADDRESS (else RAY_ADDRESS), host:port of a Ray cluster's head: the worker "
                              "runs the trials of jobs with hardware.executor ray there (docs/guides/ray.md).")
    s.add_argument("--host", default=None, help="address to bind (default: $SLTUNE_HOST, else 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="port to bind (default: $SLTUNE_PORT, else 8000)")
    s.add_argument("--db", help=DB_HELP)
    s.add_argument("--data-dir", help=DATA_DIR_HELP)
    s.add_argument("--models-dir", default=None, metavar="DIR",
                   help="the folder whose Hugging Face model folders a spec may name as model.path (relative to "
                        "it, or absolute inside it); default: $SLTUNE_MODELS_DIR, else none: specs naming "
                        "model.path are refused")
    s.add_argument("--no-worker", action="store_true", help="serve only; run workers separately")
    s.add_argument("--workers", type=int, default=None, metavar="N",
                   help="API server processes sharing the port (default: $SLTUNE_API_WORKERS, else 1); the job "
                        "worker stays one")
    s.set_defaults(run=run_serve)

    w = sub.add_parser("worker", help="one more worker on the same database",
                       description="Run queued jobs from the database, beside a server's embedded worker or "
                                   "on another machine that reaches the same database. Stops on SIGTERM/Ctrl-C, "
                                   "handing its job back for another worker to resume.",
                       epilog="environment: SLTUNE_DB, SLTUNE_DATA_DIR and the other SLTUNE_* settings; "
                              "SLTUNE_RAY_ADDRESS (else RAY_ADDRESS), host:port of a Ray cluster's head: the trials "
                              "of jobs with hardware.executor ray run there (docs/guides/ray.md).")
    w.add_argument("--db", help=DB_HELP)
    w.add_argument("--data-dir", help=DATA_DIR_HELP)
    w.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)   # serve's own worker
    w.set_defaults(run=run_worker)

    c = sub.add_parser("submit", help="post a tuning job to a server (the CI client)",
                       description="Post a tuning spec to a server; with --wait, follow it with a progress bar "
                                   "and exit 0 when it succeeds, 1 when it fails or is cancelled, 2 on an error. "
                                   "The job id is printed on stdout.",
                       epilog="environment: SLTUNE_API_TOKEN is sent as the bearer token (the server requires "
                              "it for every write).")
    c.add_argument("spec", help="tuning spec YAML (checked here before it is sent)")
    c.add_argument("--server", required=True, help=SERVER_HELP)
    c.add_argument("--wait", action="store_true", help="wait for the job, showing progress")
    c.add_argument("--out", help="with --wait: write the best config YAML here")
    c.add_argument("--timeout", type=float, help="with --wait: give up after this many seconds (default: wait "
                                                 "as long as the job runs)")
    c.set_defaults(run=run_submit)

    m = sub.add_parser("compare", help="the two jobs' bests compared with 95%% intervals; exit 1 on a regression",
                       description="Flags a regression only when the 95% interval of new/old best tokens/s lies "
                                   "wholly below 1 - max-regression. Exit codes: 0 no regression (including "
                                   "'within noise', and 'inconclusive' when the two bests were measured under "
                                   "different interference), 1 regression, 2 error.")
    m.add_argument("job_a", help="the baseline job")
    m.add_argument("job_b", help="the newer job")
    where = m.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", help=SERVER_HELP)
    where.add_argument("--db", help=DB_HELP)
    m.add_argument("--max-regression", default="5%", help="largest allowed drop of the best tokens/s, e.g. 5%%")
    m.add_argument("--remeasure", action="store_true",
                   help="run both bests again here, interleaved, and decide on the paired ratio")
    m.add_argument("--rounds", type=int, default=3, help="with --remeasure: interleaved rounds")
    m.add_argument("--json", action="store_true", help="print the comparison as JSON")
    m.set_defaults(run=run_compare)


FLAGS = {"db": "db", "data_dir": "data_dir", "host": "host", "port": "port", "api_workers": "workers",
         "models_dir": "models_dir"}   # setting: flag


def _settings(args: argparse.Namespace) -> Settings:
    """The settings, with the flags given over the environment; a bad value is named as the user gave it:
    `--workers: ...` for a flag, `SLTUNE_API_WORKERS: ...` for the environment."""
    overrides = {k: v for k, flag in FLAGS.items() if (v := getattr(args, flag, None)) is not None}
    try:
        return Settings(**overrides)
    except ValidationError as err:
        def source(key: str) -> str:
            return "--" + FLAGS[key].replace("_", "-") if key in overrides else "SLTUNE_" + key.upper()

        raise ValueError(one_line(err, name=source)) from None


def run_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if settings.api_token is None and not _loopback(settings.host):
        raise ValueError(f"refusing to serve on {settings.host} without SLTUNE_API_TOKEN: anyone could submit jobs")
    if settings.models_dir is not None and not settings.models_dir.expanduser().is_dir():
        where = "--models-dir" if args.models_dir is not None else "SLTUNE_MODELS_DIR"
        raise ValueError(f"{where} {settings.models_dir}: no such folder; give the folder of the model folders "
                         "specs may name, or leave it unset")
    if settings.healthz_min_workers is None:       # its own worker must be alive; with --no-worker, none here
        settings = settings.model_copy(update={"healthz_min_workers": 0 if args.no_worker else 1})
    open_store(settings)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serving = {"host": settings.host, "port": settings.port, "log_level": "info", "access_log": settings.access_log}
    # the job worker and the spec checkers' fork server start first: each imports torch and transformers in
    # a process of its own while this one imports the app
    with contextlib.nullcontext() if args.no_worker else job_worker(settings) as worker:
        import uvicorn

        if settings.api_workers > 1:
            # uvicorn starts each process from an import string; they read their settings from the environment
            os.environ.update(SLTUNE_DB=settings.db_url(), SLTUNE_DATA_DIR=str(settings.data_dir),
                              SLTUNE_HEALTHZ_MIN_WORKERS=str(settings.healthz_min_workers))
            if settings.models_dir is not None:
                os.environ["SLTUNE_MODELS_DIR"] = str(settings.models_dir)
            uvicorn.run("sltune.api.app:serving_process", factory=True, workers=settings.api_workers, **serving)
        else:
            forks.start()
            from sltune.api.app import create_app

            uvicorn.run(create_app(settings), **serving)
    if worker is not None and worker.gave_up:
        print(f"sltune serve: error: {worker.gave_up}", file=sys.stderr)
        return 1
    return 0


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_worker(args: argparse.Namespace) -> int:
    settings = _settings(args)
    open_store(settings)
    forks.start()           # the trials' fork server imports torch and transformers beside this process
    from sltune.service.worker import Worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    worker = Worker(settings)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop.set())
    if args.exit_with_parent:      # `sltune serve` died (kill -9, say): go too, as a killed worker would
        from sltune.profiling.lifeline import die_with_parent

        die_with_parent()
    worker.run_forever()
    return 0


def run_submit(args: argparse.Namespace) -> int:
    from sltune.service.client import Client, ServiceError

    body, max_trials = _submission(args.spec)
    client = Client(args.server)
    try:
        job_id = client.submit(body)
        print(f"submitted job {job_id} to {args.server}", file=sys.stderr)
        if not args.wait:
            print(job_id)
            return 0
        bar = JobBar(f"job {job_id}", max_trials)

        def show(job: dict) -> None:
            bar.show(job.get("progress") or {}, job["status"], job.get("waiting_for"))

        job = client.wait(job_id, show, timeout_s=args.timeout)
        bar.close()
    except ServiceError as err:
        print(f"sltune submit: error: {err}", file=sys.stderr)
        return 2
    if job["status"] != "succeeded":
        print(f"job {job_id} {job['status']}: {job.get('error') or job.get('stop_reason')}", file=sys.stderr)
        return 1
    best = job["best"]
    print(f"job {job_id} succeeded: {best['tokens_per_s']:,.1f} tokens/s with {describe_config(best['config'])}",
          file=sys.stderr)
    if args.out:
        Path(args.out).write_text(client.config_yaml(job_id))
        print(f"wrote {args.out}: train with `sltune train --config {args.out}`", file=sys.stderr)
    print(job_id)
    return 0


def _submission(path: str) -> tuple[dict, int]:
    """The body to post and its trial count. A bad spec is refused here, before the network, except for a
    model.path: that folder is the server's (inside its models_dir, relative to it), so such a spec goes as
    written and the server checks it."""
    from sltune.tuning.spec import Search, TuningSpec
    from sltune.yamlfile import read_yaml

    data = read_yaml(path)
    model = data.get("model") if isinstance(data, dict) else None
    if not (isinstance(model, dict) and model.get("path") is not None):
        spec = TuningSpec.parse(data, source=path)
        return spec.model_dump(mode="json"), spec.search.max_trials
    try:
        body = json.loads(json.dumps(data))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: not expressible as JSON ({err})") from None
    search = data.get("search") if isinstance(data.get("search"), dict) else {}
    return body, search.get("max_trials") or Search.model_fields["max_trials"].default


def run_compare(args: argparse.Namespace) -> int:
    from sltune.service.client import Client, ServiceError
    from sltune.store import Store
    from sltune.tuning.report import compare as cmp

    limit = _fraction(args.max_regression)
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: give at least 1")
    try:
        if args.server:
            client = Client(args.server)
            old, new = cmp.from_server(client, args.job_a), cmp.from_server(client, args.job_b)
        else:
            store = Store(args.db)
            old, new = cmp.from_store(store, args.job_a), cmp.from_store(store, args.job_b)
        result = cmp.compare(old, new, limit)
        if args.remeasure:
            result = cmp.remeasure(result, old, new, args.rounds)
    except (ServiceError, ValueError) as err:
        print(f"sltune compare: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return cmp.exit_code(result)
    names = [cmp.config_name(r["config"]) for r in result["rows"]]      # as the tuner names its configs
    width = max(map(len, names + ["config"]))
    print(f"{'config':<{width}} {args.job_a:>14} {args.job_b:>14} {'ratio':>7}  {'95% interval':<16} verdict")
    for name, r in zip(names, result["rows"]):
        fa = f"{r['a']:,.1f}" if r["a"] else "-"
        fb = f"{r['b']:,.1f}" if r["b"] else "-"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
        ci = f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if r["ci95"] else "-"
        print(f"{name:<{width}} {fa:>14} {fb:>14} {ratio:>7}  {ci:<16} {r.get('verdict', '-')}")
    print(cmp.summary(result))
    return cmp.exit_code(result)


def _fraction(text: str) -> float:
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise ValueError(f"--max-regression {text!r}: write a percentage such as 5% or a fraction such as 0.05")
    return value
