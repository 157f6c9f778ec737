"""`sltune compare`: a regression only when beyond the threshold and significant; documented exit codes."""

import contextlib
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest

from sltune.cli.main import main
from sltune.store import Store
from sltune.tuning.report.compare import JobData, compare
from tests.support.specs import admitted_spec
from tests.support.cli import sltune

SPEC = admitted_spec({"name": "cmp", "model": {"preset": "llama-tiny"}, "workload": {"seq_len": 32},
                      "search": {"sub_batch_size": [1, 2], "num_sub_batches": [1], "num_live_blocks": [1],
                                 "trial_steps": 3, "trial_min_time_s": 0.2, "profile": False}})


def _job(store: Store, name: str, medians: dict[int, float], spread: float, seed: int, spec=SPEC,
         busy: float | None = None) -> str:
    """A finished job in a real SQLite store whose trials' steps are drawn around the given tokens/s per
    sub-batch size (step times lognormal with the given spread)."""
    rng = np.random.default_rng(seed)
    job = store.create_job(name, spec.model_dump(mode="json"), f"{name}-{seed}", {"device": "cpu"})
    best = max(medians, key=medians.get)
    for number, (b, tps) in enumerate(medians.items()):
        tokens = b * 32
        steps = (tokens / tps * rng.lognormal(0.0, spread, 30)).tolist()
        med = float(np.median(steps))
        config = {"sub_batch_size": b, "num_sub_batches": 1, "num_live_blocks": 1, "schedule": "speedloader"}
        store.start_trial(job.id, number, "probe", config, {}, None, None)
        store.finish_trial(job.id, number, {
            "status": "ok", "config": {**config, "seq_len": 32, "world_size": 1},
            "tokens_per_s": tokens / med, "step_seconds": med,
            "timing": {"steps_s": steps, "median_s": med, "tokens_per_s_ci95": [0, 0], "cv": spread,
                       "unstable": False,
                       "interference": {} if busy is None else {"others_busy_cores": busy}}})
    store.set_status(job.id, "succeeded", result={"best": {"config": {"sub_batch_size": best, "num_sub_batches": 1,
                                                                      "num_live_blocks": 1}}})
    return job.id


def _compare(db: str, a: str, b: str, *extra: str):
    """The CLI in this process (one real subprocess below checks the process exit codes)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["compare", a, b, "--db", db, "--json", *extra])
    return code, (json.loads(out.getvalue()) if out.getvalue().strip() else None), err.getvalue()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "jobs.db"
    db = f"sqlite:///{path}"
    store = Store(db)
    ids = {
        "base": _job(store, "base", {1: 1000.0, 2: 1800.0}, 0.02, 1),
        "same": _job(store, "same", {1: 1000.0, 2: 1800.0}, 0.02, 2),
        "slower": _job(store, "slower", {1: 700.0, 2: 1260.0}, 0.02, 3),        # 30% slower, tight
        "noisy": _job(store, "noisy", {1: 900.0, 2: 1620.0}, 0.6, 4),          # 10% slower, very noisy
        "slightly": _job(store, "slightly", {1: 980.0, 2: 1764.0}, 0.01, 5),  # 2% slower: within 5%
        # the same code measured on a quiet machine (0.1 cores busy elsewhere) and beside a busy process
        "quiet": _job(store, "quiet", {1: 1000.0, 2: 1800.0}, 0.02, 6, busy=0.1),
        "hogged": _job(store, "hogged", {1: 700.0, 2: 1260.0}, 0.02, 7, busy=1.0),
        "quiet_slower": _job(store, "quiet_slower", {1: 700.0, 2: 1260.0}, 0.02, 8, busy=0.2),
    }
    empty = store.create_job("empty", SPEC.model_dump(mode="json"), "empty", {"device": "cpu"})
    store.set_status(empty.id, "failed", error="no config ran successfully")
    ids["empty"] = empty.id
    return db, ids


def test_a_significant_drop_beyond_the_threshold_is_a_regression(jobs):
    db, ids = jobs
    code, r, err = _compare(db, ids["base"], ids["slower"])
    assert code == 1, err
    assert r["verdict"] == "regression" and r["ci95"][1] < 0.95
    assert r["ratio"] == pytest.approx(0.7, rel=0.03)
    assert [row["verdict"] for row in r["rows"]] == ["regression", "regression"]   # every shared config


def test_noise_and_small_drops_pass(jobs):
    db, ids = jobs
    code, r, err = _compare(db, ids["base"], ids["same"])
    assert code == 0 and r["verdict"] in ("no regression", "within noise", "faster"), (r, err)
    code, r, _ = _compare(db, ids["base"], ids["noisy"])
    assert code == 0 and r["verdict"] == "within noise" and r["ci95"][0] < 0.95 < r["ci95"][1]
    code, r, _ = _compare(db, ids["base"], ids["slightly"])
    assert code == 0 and r["ratio"] < 1.0 and r["verdict"] in ("no regression", "within noise")
    code, r, _ = _compare(db, ids["base"], ids["slower"], "--max-regression", "40%")
    assert code == 0 and r["verdict"] == "no regression"


def test_bests_measured_under_different_interference_are_inconclusive_not_a_regression(jobs):
    """The jobs' trials cannot tell a slower machine from slower code: a drop measured beside a busy process
    that the old job did not have is "inconclusive" (exit 0) and says so; under comparable interference
    the same drop is a regression."""
    db, ids = jobs
    code, r, err = _compare(db, ids["quiet"], ids["hogged"])
    assert code == 0 and r["verdict"] == "inconclusive", (r, err)
    assert r["busy_elsewhere"] == pytest.approx([0.1, 1.0]) and r["ci95"][1] < 0.95
    assert {row["verdict"] for row in r["rows"]} == {"inconclusive"}
    from sltune.tuning.report.compare import summary
    assert "--remeasure" in summary(r) and "1.00 while the new one was" in summary(r)
    code, r, _ = _compare(db, ids["quiet"], ids["quiet_slower"])
    assert code == 1 and r["verdict"] == "regression" and r["busy_elsewhere"] is None


def test_errors_exit_2_with_one_line(jobs):
    db, ids = jobs
    code, _, err = _compare(db, ids["base"], "nope")
    assert code == 2 and "no job 'nope'" in err and "Traceback" not in err
    code, _, err = _compare(db, ids["base"], ids["empty"])
    assert code == 2 and "no successful trial" in err
    code, _, err = _compare(db, ids["base"], ids["same"], "--max-regression", "lots")
    assert code == 2 and "--max-regression" in err


def test_the_process_exit_codes(jobs):
    db, ids = jobs
    for other, code in (("slower", 1), ("same", 0), ("empty", 2)):
        out = sltune("compare", ids["base"], ids[other], "--db", db)
        assert out.returncode == code, (other, out.stdout, out.stderr)
    assert "REGRESSION" in sltune("compare", ids["base"], ids["slower"], "--db", db).stdout


def test_remeasure_runs_both_bests_here_interleaved(jobs, monkeypatch):
    """The two jobs' stored figures say 30% slower; re-measured side by side the paired interval decides. The
    re-measurements are set here (issue #23: real ones beside a busy process once judged a same-spec re-run a
    regression beyond 25%): the new side runs a known 10% slower, and the machine changes between rounds
    (0.6x, then 1.3x, the way another process comes and goes). Paired, the ratio is the 10% whatever the
    machine did: within a 25% allowance, a regression against 5%."""
    import sltune.profiling

    db, ids = jobs
    order = ["old", "new", "new", "old", "old", "new"]           # interleaved: each round swaps who goes first
    machine = [1.0, 0.6, 1.3]
    ran = []

    def run_trial(spec, stop=None):
        i = len(ran)
        ran.append(spec)
        speed = 1800.0 * machine[i // 2] * (0.9 if order[i] == "new" else 1.0)
        tokens = spec.sub_batch_size * spec.num_sub_batches * spec.seq_len
        steps = (tokens / speed * np.random.default_rng(i).lognormal(0.0, 0.01, 20)).tolist()
        return SimpleNamespace(model_dump=lambda mode=None: {
            "status": "ok", "tokens_per_s": speed, "step_seconds": float(np.median(steps)),
            "timing": {"steps_s": steps, "median_s": float(np.median(steps)), "tokens_per_step": tokens}})

    monkeypatch.setattr(sltune.profiling, "run_trial", run_trial)
    code, r, err = _compare(db, ids["base"], ids["slower"], "--remeasure", "--rounds", "3", "--max-regression", "25%")
    assert code == 0, (r, err)
    assert len(ran) == 6 and all(s.sub_batch_size == 2 and not s.profile for s in ran)   # each job's best, as specced
    assert r["remeasured"]["rounds"] == 3 and len(r["remeasured"]["new_round_medians"]) == 3
    assert r["remeasured"]["from_jobs"]["verdict"] == "regression"
    assert r["ratio"] == pytest.approx(0.9, rel=0.01) and r["ci95"][0] < 0.9 < r["ci95"][1] < 1.0
    assert r["verdict"] == "no regression"
    ran.clear()
    code, r, err = _compare(db, ids["base"], ids["slower"], "--remeasure", "--rounds", "3")
    assert code == 1 and r["verdict"] == "regression" and r["ratio"] == pytest.approx(0.9, rel=0.01), (r, err)


def test_trials_from_before_weights_on_device_compare_as_keeping_none():
    def job(name: str, share: dict) -> JobData:
        config = {"sub_batch_size": 1, "num_sub_batches": 1, "num_live_blocks": 1, "kv_cache": "host", **share}
        return JobData(name, "succeeded", {}, None, [{"number": 0, "role": "probe", "status": "ok", "config": config,
                                                     "result": {"status": "ok", "tokens_per_s": 100.0}}])

    rows = compare(job("old", {}), job("new", {"weights_on_device": 0.0}))["rows"]
    assert [(r["config"]["weights_on_device"], r["a"], r["b"]) for r in rows] == [(0.0, 100.0, 100.0)]
    rows = compare(job("old", {}), job("new", {"weights_on_device": 1.0}))["rows"]
    assert [(r["config"]["weights_on_device"], r["a"], r["b"]) for r in rows] == [(0.0, 100.0, None),
                                                                                  (1.0, None, 100.0)]


def test_host_and_disk_configs_of_the_same_knobs_are_two_rows_and_a_disk_best_remeasures_in_its_own_folder():
    """optimizer_offload is a knob: a host trial and a disk trial of the same b, N, k are different configs (a trial
    from before the knob ran host), and a disk best re-measures for real, its files in a folder of its own."""
    from sltune.tuning.report.compare import remeasure

    def job(name: str, offload: dict) -> JobData:
        config = {"sub_batch_size": 1, "num_sub_batches": 1, "num_live_blocks": 1, **offload}
        spec = {**SPEC.model_dump(mode="json"), "search": {**SPEC.search.model_dump(mode="json"),
                                                           "optimizer_offload": ["host", "disk"]}}
        return JobData(name, "succeeded", spec, {"config": config},
                       [{"number": 0, "role": "probe", "status": "ok", "config": config,
                         "result": {"status": "ok", "tokens_per_s": 100.0}}])

    rows = compare(job("old", {}), job("new", {"optimizer_offload": "host"}))["rows"]
    assert [(r["config"]["optimizer_offload"], r["a"], r["b"]) for r in rows] == [("host", 100.0, 100.0)]
    old, new = job("old", {}), job("new", {"optimizer_offload": "disk"})
    cmp = compare(old, new)
    assert sorted((r["config"]["optimizer_offload"], r["a"], r["b"]) for r in cmp["rows"]) == [
        ("disk", None, 100.0), ("host", 100.0, None)]
    r = remeasure(cmp, old, new, rounds=1)
    assert r["remeasured"]["rounds"] == 1 and r["ratio"] > 0


def test_help_texts_render():
    """Every command's -h; none shows argparse's escaped "%%" (a description, unlike a help, is printed as
    written: `compare -h` said "95%%")."""
    import argparse

    from sltune.cli.main import parser

    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for argv in [["--help"]] + [[name, "--help"] for name in commands]:
        with contextlib.redirect_stdout(io.StringIO()) as out, pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0 and "usage" in out.getvalue() and "%%" not in out.getvalue(), argv
        if argv[0] == "compare":
            assert "the 95% interval of new/old" in " ".join(out.getvalue().split())


def _unstable_job(store: Store, name: str, tps: float, seed: int) -> str:
    """A finished job whose one config (b=4 N=2 k=1, the optimizer on disk) was measured under interference."""
    rng = np.random.default_rng(seed)
    config = {"sub_batch_size": 4, "num_sub_batches": 2, "num_live_blocks": 1, "optimizer_offload": "disk",
              "schedule": "speedloader"}
    job = store.create_job(name, SPEC.model_dump(mode="json"), f"{name}-{seed}", {"device": "cpu"})
    tokens = 4 * 2 * 32
    steps = (tokens / tps * rng.lognormal(0.0, 0.02, 30)).tolist()
    med = float(np.median(steps))
    store.start_trial(job.id, 0, "probe", config, {}, None, None)
    store.finish_trial(job.id, 0, {"status": "ok", "config": {**config, "seq_len": 32, "world_size": 1},
                                   "tokens_per_s": tokens / med, "step_seconds": med,
                                   "timing": {"steps_s": steps, "median_s": med, "tokens_per_s_ci95": [0, 0],
                                              "cv": 0.02, "unstable": True, "interference": {}}})
    store.set_status(job.id, "succeeded", result={"best": {"config": config}})
    return job.id


@pytest.fixture(scope="module")
def unstable(tmp_path_factory):
    from sltune.api.app import create_app
    from sltune.settings import Settings

    tmp = tmp_path_factory.mktemp("unstable")
    app = create_app(Settings(data_dir=tmp / "data", db=f"sqlite:///{tmp / 'jobs.db'}"))
    store = app.state.store
    return app, store.url, _unstable_job(store, "old", 1000.0, 1), _unstable_job(store, "new", 990.0, 2)


def test_the_verdict_names_a_config_as_the_tuner_does_not_as_a_python_dict(unstable, capsys):
    """A best measured under interference was named `{'sub_batch_size': 4, ..., 'kv_cache': None, ...}` in the
    verdict of `sltune compare` and of /dashboard/compare; both name it as the tuner does."""
    from fastapi.testclient import TestClient

    app, db, a, b = unstable
    assert main(["compare", a, b, "--db", db]) == 0
    out = capsys.readouterr().out
    assert "{'" not in out and "None" not in out, out
    assert f"note: measured under interference: {a} b=4 N=2 k=1 optimizer_offload=disk; {b} b=4 N=2 k=1 " \
           "optimizer_offload=disk" in out, out
    assert "b=4 N=2 k=1 optimizer_offload=disk" in out.splitlines()[1]          # the table's row, every knob
    with TestClient(app) as client:
        page = client.get("/dashboard/compare", params={"a": a, "b": b}).text
    assert "{&#x27;" not in page and "{'" not in page and "kv_cache" not in page, page
    assert f"measured under interference: {a} b=4 N=2 k=1 optimizer_offload=disk" in page
    assert "<td>b=4 N=2 k=1 optimizer_offload=disk</td>" in page


# -- backends (issue #33) ------------------------------------------------------------------------------
SL = {"sub_batch_size": 4, "num_sub_batches": 2, "num_live_blocks": 1, "schedule": "speedloader"}
DS = {"backend": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu", "offload_param": "none"}
FSDP = {"backend": "fsdp", "cpu_offload": False, "reshard_after_forward": True}
RAN_ELSEWHERE = {"sub_batch_size": 4, "num_sub_batches": 2, "num_live_blocks": None, "schedule": None}


def _backend_job(store: Store, name: str, trials: list, best: int, seed: int) -> str:
    """A finished job in a real SQLite store over backends: trials (number, status, stored config, the result's
    config, tokens/s), step times drawn around the tokens/s; its best is trial `best`, named by its stored
    config (which may not say the backend) and its number."""
    rng = np.random.default_rng(seed)
    job = store.create_job(name, SPEC.model_dump(mode="json"), f"{name}-{seed}", {"device": "cpu"})
    for number, status, stored, ran, tps in trials:
        tokens = 4 * 2 * 32
        steps = (tokens / tps * rng.lognormal(0.0, 0.02, 30)).tolist()
        med = float(np.median(steps))
        store.start_trial(job.id, number, "probe", stored, {}, None, None)
        store.finish_trial(job.id, number, {
            "status": status, "error": None if status == "ok" else "step-1 loss off plain PyTorch's",
            "config": {**ran, "seq_len": 32, "world_size": 1}, "tokens_per_s": tokens / med, "step_seconds": med,
            "timing": {"steps_s": steps, "median_s": med, "tokens_per_s_ci95": [0, 0], "cv": 0.02,
                       "unstable": False, "interference": {}}})
    config = next(stored for number, _, stored, _, _ in trials if number == best)
    store.set_status(job.id, "succeeded", result={"best": {"trial_number": best, "config": config}})
    return job.id


@pytest.fixture(scope="module")
def backend_jobs(tmp_path_factory):
    """Two jobs over SpeedLoader, DeepSpeed and FSDP at the same b=4 N=2: DeepSpeed runs half as fast in the new
    one, the rest alike. The old one's SpeedLoader trial is from before there were backends (named nowhere), its
    DeepSpeed trial names its backend in its result only, with the k a candidate stores by default; the new one
    names every backend, leaves DeepSpeed's offload_param (its default) out, and has a diverged FSDP trial."""
    db = f"sqlite:///{tmp_path_factory.mktemp('backends') / 'jobs.db'}"
    store = Store(db)
    old = [(0, "ok", SL, SL, 1000.0),
           (1, "ok", {**SL, "schedule": None}, {**RAN_ELSEWHERE, **DS}, 500.0),
           (2, "ok", {**RAN_ELSEWHERE, **FSDP}, {**RAN_ELSEWHERE, **FSDP}, 800.0)]
    new = [(0, "ok", SL, {**SL, "backend": "speedloader"}, 1000.0),
           (1, "ok", {**RAN_ELSEWHERE, **DS, "offload_param": None}, {**RAN_ELSEWHERE, **DS}, 250.0),
           (2, "ok", {**RAN_ELSEWHERE, **FSDP}, {**RAN_ELSEWHERE, **FSDP}, 800.0),
           (3, "diverged", {**RAN_ELSEWHERE, **FSDP, "cpu_offload": True},
            {**RAN_ELSEWHERE, **FSDP, "cpu_offload": True}, 9000.0)]
    return db, {"old": _backend_job(store, "old", old, 0, 1), "new": _backend_job(store, "new", new, 0, 2),
                # a job whose pick is its DeepSpeed config though SpeedLoader's ran faster; the best's stored
                # config does not name the backend, its trial's result does
                "deepspeed_pick": _backend_job(store, "deepspeed-pick", old, 1, 3)}


def test_configs_of_different_backends_are_never_pooled(backend_jobs, capsys):
    """Issue #33: SpeedLoader's, DeepSpeed's and FSDP's b=4 N=2 are three rows, each compared with its own
    backend's: DeepSpeed's halving is a regression on its row alone; the bests (SpeedLoader's) are alike. A trial
    from before there were backends is SpeedLoader's; a diverged trial is no sample."""
    db, ids = backend_jobs
    code, r, err = _compare(db, ids["old"], ids["new"])
    assert code == 0 and r["verdict"] in ("no regression", "within noise", "faster"), (r, err)
    rows = {row["config"]["backend"]: row for row in r["rows"]}
    assert [row["config"]["backend"] for row in r["rows"]] == ["speedloader", "deepspeed", "fsdp"]
    assert rows["speedloader"]["a"] == pytest.approx(1000, rel=0.03) and rows["speedloader"]["ratio"] == \
        pytest.approx(1.0, rel=0.03)
    assert rows["deepspeed"]["a"] == pytest.approx(500, rel=0.03) and rows["deepspeed"]["b"] == \
        pytest.approx(250, rel=0.03) and rows["deepspeed"]["verdict"] == "regression"
    assert rows["fsdp"]["b"] == pytest.approx(800, rel=0.03)               # the diverged 9000 is not pooled in
    # a config's key is its backend and that backend's knobs, nothing of another's
    assert {k: rows["deepspeed"]["config"][k] for k in ("zero_stage", "offload_optimizer", "offload_param",
                                                        "num_live_blocks", "cpu_offload")} == \
        {"zero_stage": 2, "offload_optimizer": "cpu", "offload_param": "none", "num_live_blocks": None,
         "cpu_offload": None}
    assert r["best_config_a"]["backend"] == r["best_config_b"]["backend"] == "speedloader"
    assert main(["compare", ids["old"], ids["new"], "--db", db]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("deepspeed "))
    assert line.startswith("deepspeed b=4 N=2 zero_stage=2 offload_optimizer=cpu offload_param=none ")
    assert line.endswith("regression") and "None" not in out
    assert any(x.startswith("b=4 N=2 k=1 ") for x in out.splitlines())      # SpeedLoader's, named as before


def test_a_job_whose_pick_is_another_backend_compares_that_pick(backend_jobs):
    """The job's own pick is its best, by backend: its stored config does not name DeepSpeed, its trial does."""
    db, ids = backend_jobs
    code, r, err = _compare(db, ids["deepspeed_pick"], ids["new"])
    assert r["best_config_a"]["backend"] == "deepspeed" and r["best_a"] == pytest.approx(500, rel=0.03), (r, err)
    assert r["best_config_b"]["backend"] == "speedloader" and code == 0 and r["verdict"] == "faster"


def test_a_wrapped_backends_best_remeasures_as_that_backend():
    """`--remeasure` of a job whose best is FSDP's runs real FSDP2 trials (it used to refuse: its candidates ran
    SpeedLoader only), each result naming the backend and its knobs."""
    from sltune.profiling import run_trial
    from sltune.tuning.report.compare import remeasure

    config = {"sub_batch_size": 1, "num_sub_batches": 2, **FSDP}
    search = {k: v for k, v in SPEC.search.model_dump(mode="json").items() if k != "num_live_blocks"}
    spec = {**SPEC.model_dump(mode="json"), "search": {**search, "backend": ["fsdp"]}}
    jobs = [JobData(name, "succeeded", spec, {"config": config},
                    [{"number": 0, "role": "probe", "status": "ok", "config": config,
                      "result": {"status": "ok", "tokens_per_s": 100.0, "config": config}}]) for name in ("a", "b")]
    ran = []

    def run(trial):
        ran.append(run_trial(trial).model_dump(mode="json"))
        return ran[-1]

    r = remeasure(compare(*jobs), *jobs, rounds=1, run=run)
    assert r["remeasured"]["rounds"] == 1 and r["ratio"] > 0
    assert [x["status"] for x in ran] == ["ok", "ok"] and all(x["parity"]["ok"] for x in ran), ran
    assert all({k: x["config"][k] for k in ("backend", "cpu_offload", "reshard_after_forward")} ==
               {"backend": "fsdp", "cpu_offload": False, "reshard_after_forward": True} for x in ran)


def test_config_names_lead_with_a_backend_other_than_speedloader():
    from sltune.tuning.report.compare import config_name

    assert config_name({**SL, "backend": "speedloader"}) == config_name(SL) == "b=4 N=2 k=1"
    assert config_name({**RAN_ELSEWHERE, **FSDP}) == "fsdp b=4 N=2 cpu_offload=false reshard_after_forward=true"
    assert config_name({"sub_batch_size": 1, "num_sub_batches": 8, "backend": "deepspeed"}) == \
        "deepspeed b=1 N=8 zero_stage=2 offload_optimizer=none offload_param=none"        # its defaults
