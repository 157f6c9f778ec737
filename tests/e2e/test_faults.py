"""Faults the service must survive (issue #24): a PostgreSQL restart under a running job, a full disk under
`sltune serve`, its embedded worker dying; ceilings that hold for every rank and round; inputs that could
never be stored and read back; a storm of large POSTs beside /healthz.

One `sltune serve` with its embedded worker serves most of these, its data directory (the SQLite store and
the traces) on a 20 MB tmpfs; its last test kills it. A `sltune worker` on PostgreSQL rides out restarts of a
real server, a private one the test starts and restarts (the shared one serves the other PostgreSQL tests)."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.support.postgres import private_postgres
from tests.support.servers import FAST_LEASES, Proc, Services, TOKEN, wait_for
from tests.support.specs import tiny_spec

ROOT = Path(__file__).resolve().parents[2]
CORES = len(os.sched_getaffinity(0))
SERVER_ENV = {"SLTUNE_MAX_TRIALS": "6", "SLTUNE_MAX_TRIAL_STEPS": "5", "SLTUNE_MAX_CONFIRM_ROUNDS": "10",
              "SLTUNE_MAX_TOKENS_PER_STEP": "1024", "SLTUNE_MIN_FREE_BYTES": "3MiB",
              "SLTUNE_EMBEDDED_WORKER_RESTARTS": "1", "SLTUNE_HEALTH_INTERVAL_S": "0.25",
              "SLTUNE_DB_RETRY_S": "10"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`sltune serve` with its worker; data directory (store, traces) on a 20 MB tmpfs where mounting is
    allowed (else a plain directory, and the full-disk test skips)."""
    tmp = tmp_path_factory.mktemp("faults")
    data = tmp / "data"
    data.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(data)], capture_output=True,
                           text=True)
    svc = Services(tmp, f"sqlite:///{data / 'jobs.db'}")
    svc.env.update(SERVER_ENV)
    svc.tmpfs = mount.stderr.strip() or None if mount.returncode else True
    svc.data = data
    svc.serve(worker=True)
    yield svc
    svc.stop()
    if mount.returncode == 0:
        subprocess.run(["umount", "-l", str(data)], capture_output=True)


def post(client: httpx.Client, spec: dict) -> httpx.Response:
    return client.post("/tune", json=spec)


def msgs(r: httpx.Response) -> list[str]:
    return [e["msg"] for e in r.json()["detail"]]


# -- inputs (8, 9) ---------------------------------------------------------------------------------------------
def test_unstorable_inputs_are_refused_naming_the_field_and_a_stored_one_stays_readable(server):
    from sltune.store import Store

    def raw(body: str) -> httpx.Response:
        return c.post("/tune", content=body.encode("utf-8", "surrogatepass"),
                      headers={"content-type": "application/json"})

    with server.client() as c:
        spec = tiny_spec("surrogate")
        spec["model"] = {"hf_config": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                       "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 512,
                                       "label": "\udfff"}}
        for body, field in ((json.dumps(spec), "model.hf_config.label"),                # \udfff, escaped
                            (json.dumps(spec, ensure_ascii=False), "model.hf_config.label"),   # raw bytes
                            (json.dumps({**spec, "model": {"preset": "llama-tiny", "dtype": "\udfff"}}),
                             "model.dtype"),
                            (json.dumps({**spec, "model": {"hf_config": {**spec["model"]["hf_config"],
                                                                         "torch_dtype": "\udfff"}}}),
                             "model.hf_config.torch_dtype")):
            r = raw(body)
            assert r.status_code == 422, r.text
            assert any(m.startswith(f"{field}: holds a lone UTF-16 surrogate") for m in msgs(r)), r.text
        r = raw(json.dumps(spec).replace('"label": "\\udfff"', '"label": 1e400'))
        assert r.status_code == 422 and msgs(r) == [
            "model.hf_config.label: is out of range for a number (beyond about ±1.8e308, or NaN); give a finite "
            "number"], r.text
        for deep in ("[" * 1000 + "]" * 1000, '{"a":' * 1000 + "1" + "}" * 1000, '{"a":' * 100 + "1" + "}" * 100):
            r = raw(deep)
            assert r.status_code == 422 and "nested" in msgs(r)[0], r.text
        assert c.get("/jobs").status_code == 200      # nothing of them was stored

        # a job stored with one anyway (before the edge refused them, or by another writer) reads back
        store = Store(server.db)
        bad = {**spec, "name": "old", "search": {"max_trials": 1}}
        job = store.create_job("old", bad, "0" * 64, {"device": "cpu"}, status="cancelled")
        r = c.get(f"/jobs/{job.id}")
        assert r.status_code == 200 and r.json()["spec"]["model"]["hf_config"]["label"] == "\ufffd", r.text
        assert c.get("/jobs").status_code == 200 and c.get(f"/dashboard/jobs/{job.id}").status_code == 200


def test_a_job_stored_with_a_lone_surrogate_reads_back_on_postgresql(pg_url):
    from sqlalchemy import text

    from sltune.api.schemas import JobDetail
    from sltune.service.jobs import job_detail
    from sltune.settings import Settings
    from sltune.store import Store

    store = Store(pg_url)
    job = store.create_job("old", {"model": {"hf_config": {"x": "a\udfffb", "\udfff": 1}}, "search": {"max_trials": 1}},
                           "0" * 64, {"device": "cpu"}, status="cancelled")
    read = store.job(job.id)
    assert read.spec["model"]["hf_config"] == {"x": "a\ufffdb", "\ufffd": 1}
    assert "a\ufffdb" in JobDetail.model_validate(job_detail(store, read, Settings())).model_dump_json()
    with store.Session() as s:        # what was stored is kept as it was
        assert "\\udfff" in s.execute(text("SELECT spec::text FROM sltune_jobs")).scalar()


def test_the_cli_refuses_a_huge_a_deep_or_a_non_utf8_yaml_in_one_line_naming_the_file(tmp_path, capsys):
    """11: a 50 MB YAML ran for minutes; 5,000 levels ended in "RecursionError (unexpected)"; non-UTF-8 bytes
    gave a line without the file's name."""
    from sltune.cli.main import main

    huge, deep, latin = tmp_path / "huge.yaml", tmp_path / "deep.yaml", tmp_path / "latin.yaml"
    huge.write_bytes(b"name: x\n" + b"# padding\n" * 120_000)
    deep.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    latin.write_bytes("name: x\nmodel: {preset: caf\xe9}\n".encode("latin-1"))
    for path, words in ((huge, "1.1 MiB is more than a spec or config holds"), (deep, "nested too deep"),
                        (latin, "line 2: not UTF-8 text (byte 0xe9)")):
        for command in (["tune", str(path)], ["plan", "--from", str(path)]):
            t0 = time.monotonic()
            assert main(command) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{path}: " in err.replace(f"{path} line", f"{path}: line") and \
                words in err, err
            assert time.monotonic() - t0 < 10


# -- ceilings (3-7) --------------------------------------------------------------------------------------------
def test_ceilings_hold_for_every_rank_round_and_confirmation_at_admission(server):
    with server.client() as c:
        # 4: tokens per step count every rank's batch (2 * 384 = 768 per rank, under 1024; 1536 on 2 ranks)
        one = tiny_spec("tokens", sub_batch_size=[1, 2], num_sub_batches=[1], num_live_blocks=[1])
        one["workload"] = {"seq_len": 384}
        one["hardware"] = {"device_memory_limit": "8MiB"}    # a 384-token row's logits need more than 3 MiB
        queued = [post(c, one).json()["job_id"]]
        two = {**one, "hardware": {**one["hardware"], "world_size": 2}}
        r = post(c, two)
        assert r.status_code == 422 and "1536 tokens per step" in r.text and "world_size" in r.text, r.text
        # 5: confirm_rounds has a ceiling of its own
        r = post(c, tiny_spec(confirm_rounds=11))
        assert r.status_code == 422 and msgs(r) == [
            "search.confirm_rounds: 11 is above this server's limit of 10; ask for at most 10"], r.text
        # 6: trial_max_steps, asked for, is refused above the ceiling; left out, it is lowered to it
        r = post(c, tiny_spec(trial_max_steps=6))
        assert r.status_code == 422 and msgs(r)[0].startswith("search.trial_max_steps: 6 is above"), r.text
        queued.append(post(c, tiny_spec("default-steps")).json()["job_id"])
        job = c.get(f"/jobs/{queued[-1]}").json()
        assert job["spec"]["search"]["trial_max_steps"] == 5
        assert job["limits"]["search.trial_max_steps"] == {"requested": None, "applied": 5, "by": "server"}
        assert job["limits"]["trials_in_all"] == {"requested": 3, "applied": 3, "by": "request"}
        # 7: cpu_threads at most the server's cores (shared by the ranks)
        for threads in (256, 10**30):
            r = post(c, {**tiny_spec(), "hardware": {"cpu_threads": threads}})
            assert r.status_code == 422 and msgs(r)[0].startswith("hardware.cpu_threads: ") and \
                f"at most {CORES}" in msgs(r)[0], r.text
        queued.append(post(c, {**tiny_spec("threads"), "hardware": {"cpu_threads": CORES}}).json()["job_id"])
        for job_id in queued:          # accepted is all they had to show; the worker has better things to run
            assert c.post(f"/jobs/{job_id}/cancel").status_code == 200


def test_the_worker_holds_steps_and_threads_to_its_own_ceilings_whatever_the_stored_spec_says():
    from sltune.tuning.search.trials import trial_spec
    from sltune.tuning.space import Candidate
    from sltune.tuning.spec import TuningSpec

    spec = TuningSpec.model_validate({**tiny_spec(trial_max_steps=400, trial_steps=50),
                                      "hardware": {"cpu_threads": 256, "world_size": 2}})
    t = trial_spec(spec, Candidate(1, 1, 1), None, max_trial_steps=5)
    assert (t.steps, t.max_steps, t.remeasure) == (5, 5, 0)        # every timed step of every round: <= 5
    assert t.cpu_threads == max(1, CORES // 2)
    t = trial_spec(spec, Candidate(1, 1, 1), None, max_trial_steps=1000)
    assert (t.steps, t.max_steps, t.remeasure) == (50, 400, 1)


def test_jobs_run_within_the_trial_and_step_ceilings_and_a_one_config_grid_succeeds(server):
    with server.client() as c:
        # 5 and 6: 5 search trials and up to 3 x 10 confirmation trials asked, 6 in all allowed; every trial
        # wants 30 s of steps (tens of ms each), at most 5 allowed. The one confirmation trial left starts a round
        # it cannot finish, so the cap (not a settled race, as two search trials and two rounds allowed) ends it
        spec = tiny_spec("confirm", trials=5, strategy="grid", sub_batch_size=[1, 2, 3, 4, 5], num_sub_batches=[1],
                         num_live_blocks=[1], confirm_rounds=10, trial_min_time_s=30)
        spec["hardware"] = {}
        confirm = post(c, spec).json()["job_id"]
        # 10: a grid of one config
        grid = post(c, tiny_spec("grid1", trials=3, strategy="grid", sub_batch_size=[1], num_sub_batches=[1],
                                 num_live_blocks=[1])).json()["job_id"]
        job = wait_for(c, confirm, timeout=180)
        assert job["status"] == "succeeded", job
        assert job["limits"]["trials_in_all"] == {"requested": 35, "applied": 6, "by": "server"}
        trials = c.get(f"/jobs/{confirm}/trials").json()
        assert len(trials) == 6 and sum(t["role"] == "confirm" for t in trials) == 1, trials
        assert "6 trials in all" in job["stop_reason"]
        for t in trials:
            timing = t["result"]["timing"]
            assert len(timing["steps_s"]) <= 5 and timing["rounds"] == 1, timing
        job = wait_for(c, grid, timeout=120)
        assert job["status"] == "succeeded" and job["best"]["config"]["sub_batch_size"] == 1, job
        assert len(c.get(f"/jobs/{grid}/trials").json()) == 1
        # 13: the config is served as the YAML mapping the document declares
        doc = c.get("/openapi.json").json()
        content = doc["paths"]["/jobs/{job_id}/config.yaml"]["get"]["responses"]["200"]["content"]
        # (and DeepSpeed's config, format=ds_config, as the JSON mapping it is)
        assert list(content) == ["application/yaml", "application/json"]
        assert all(content[media]["schema"]["type"] == "object" for media in content)
        r = c.get(f"/jobs/{grid}/config.yaml")
        assert r.headers["content-type"].startswith("application/yaml") and isinstance(yaml.safe_load(r.text), dict)
        schemas = doc["components"]["schemas"]
        assert schemas["Search"]["properties"]["max_trials"]["maximum"] == 6
        assert schemas["Search"]["properties"]["trial_max_steps"]["maximum"] == 5
        assert schemas["Workload"]["properties"]["seq_len"]["maximum"] == 1024
        assert schemas["Hardware"]["properties"]["cpu_threads"]["anyOf"][0]["maximum"] == CORES


def test_the_host_limit_holds_for_all_ranks_of_a_trial_together():
    """3: two ranks of ~0.9 GB resident each (most of it the libraries they share with the fork server) hold
    ~1.3 GB together: a 1.1 GB limit stops the trial, which it used to let finish 'ok' rank by rank."""
    from sltune.profiling import run_trial

    config = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 2,
              "num_attention_heads": 16, "vocab_size": 512, "max_position_embeddings": 256}
    r = run_trial({"model": config, "sub_batch_size": 1, "num_sub_batches": 1, "seq_len": 16, "world_size": 2,
                   "steps": 1, "min_time_s": 0, "profile": False, "host_memory_limit": "1100MiB", "timeout_s": 120})
    assert r.status == "oom" and r.oom_resource == "host", r
    assert "ranks together" in r.error and r.peak_host_bytes > 1100 * 2**20, r.error


# -- a storm beside /healthz (14) ------------------------------------------------------------------------------
def test_healthz_stays_fast_under_a_storm_of_200_large_posts(server):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "storm.py"), "--url", server.url, "--token", TOKEN,
                          "--posts", "200", "--kb", "200", "--rounds", "1", "--max-trials", "1000000",
                          "--nice", "10", "--json"],          # the sender stands for clients elsewhere
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rounds = json.loads(run.stdout.strip().splitlines()[-1])
    for x in rounds:
        assert x["kb"] >= 200 and x["healthz_n"] >= 20, x
        assert x["healthz_status"] == {"200": x["healthz_n"]}, x
        assert set(x["post_status"]) <= {"422", "503"}, x           # every spec refused: no job queued
    # how fast is the benchmark's to say (bench/storm.py prints p99 and max; the project keeps timing goals out
    # of unit tests, which a shared machine makes noisy): here, every probe was answered and every POST refused


# -- a full disk (2) -------------------------------------------------------------------------------------------
def empty_wal(db: str) -> None:
    """Checkpoint a SQLite store and truncate its WAL, so that its next write must grow a file."""
    from sqlalchemy import text

    from sltune.store import Store

    deadline = time.monotonic() + 10
    with Store(db).Session() as s:
        while s.execute(text("PRAGMA wal_checkpoint(TRUNCATE)")).one()[0] and time.monotonic() < deadline:
            s.rollback()
            time.sleep(0.1)            # busy: another connection held it back


def test_a_full_disk_costs_a_trial_its_trace_and_posts_a_507_but_no_worker(server):
    if server.tmpfs is not True:
        pytest.skip(f"no tmpfs could be mounted for the data directory: {server.tmpfs}")
    filler = server.data / "filler"

    def fill(leave: int) -> None:
        """Grow the filler until `leave` bytes are free (or none: the others write too)."""
        with open(filler, "ab", buffering=0) as f:
            while (free := shutil.disk_usage(server.data).free) > leave:
                try:
                    f.write(b"\0" * min(free - leave, 1 << 20))
                except OSError:
                    break

    def health(status: int) -> dict:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            r = c.get("/healthz")
            if r.status_code == status:
                return r.json()
            time.sleep(0.1)
        raise AssertionError(r.text)

    workers = [p.pid for p in psutil.Process(server.procs[0].p.pid).children() if "worker" in p.cmdline()]
    empty_wal(server.db)
    with server.client() as c:
        try:
            fill(leave=0)
            big = tiny_spec("big", trials=1)
            big["model"] = {"hf_config": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
                                          "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 512,
                                          "id2label": {str(i): f"LABEL_{i:06d}" for i in range(8000)}}}
            r = post(c, big)
            assert r.status_code == 507 and "storage is full" in r.json()["detail"], r.text
            h = health(503)
            assert h["free_bytes"] < 3 * 2**20 and any("free space" in p for p in h["problems"]), h

            filler.unlink()
            fill(leave=1 << 20)          # room for the store's rows, not for a trace (1.4 MB)
            job = wait_for(c, post(c, tiny_spec("no-room", trials=1, profile=True)).json()["job_id"], timeout=120)
            assert job["status"] == "succeeded", job
            [trial] = c.get(f"/jobs/{job['id']}/trials").json()
            assert trial["status"] == "ok" and trial["trace_url"] is None, trial
            assert trial["result"]["trace_error"].startswith("no trace: it could not be written"), trial["result"]
        finally:
            filler.unlink(missing_ok=True)
        assert health(200)["problems"] == []
        job = wait_for(c, post(c, tiny_spec("room", trials=1, profile=True)).json()["job_id"], timeout=120)
        assert job["status"] == "succeeded", job
        [trial] = c.get(f"/jobs/{job['id']}/trials").json()
        assert c.get(trial["trace_url"]).status_code == 200
    now = [p.pid for p in psutil.Process(server.procs[0].p.pid).children() if "worker" in p.cmdline()]
    assert now == workers          # the same worker throughout


# -- the embedded worker (2) -----------------------------------------------------------------------------------
def test_serve_restarts_its_embedded_worker_then_exits_non_zero_when_it_keeps_dying(server):
    serve = server.procs[0]

    def worker_pids() -> list[int]:
        return [p.pid for p in psutil.Process(serve.p.pid).children() if "worker" in p.cmdline()]

    def wait(what, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if got := what():
                return got
            time.sleep(0.1)
        raise AssertionError(f"timed out; serve's log:\n{serve.output()[-3000:]}")

    [first] = worker_pids()
    os.kill(first, signal.SIGKILL)
    with server.client() as c:         # the lease (3 s) runs out: no live worker, and /healthz says so
        h = wait(lambda: (r := c.get("/healthz")).status_code == 503 and r.json())
        assert h["workers"] == 0 and "live worker" in h["problems"][0], h
    [second] = wait(lambda: [p for p in worker_pids() if p != first])
    os.kill(second, signal.SIGKILL)       # beyond SLTUNE_EMBEDDED_WORKER_RESTARTS=1: serve gives up
    assert wait(lambda: serve.p.poll() is not None) and serve.p.returncode != 0
    assert "embedded worker exited" in serve.output()


# -- a PostgreSQL restart (1) ----------------------------------------------------------------------------------
@pytest.fixture
def private_pg(pg_server_url):
    """A PostgreSQL server of the test's own to restart (a PostgreSQL test: it runs where CI sets
    SLTUNE_TEST_PG_URL); restarting the shared one broke the PostgreSQL tests running beside it."""
    with private_postgres() as server:
        yield server


def test_a_worker_rides_out_postgresql_restarts_mid_job(private_pg, tmp_path):
    from sltune.service.validation import check
    from sltune.settings import Settings
    from sltune.store import Store

    from sqlalchemy.exc import OperationalError

    class Patient(Store):
        """The test's own reads, waiting out the restarts it makes."""

        def __getattribute__(self, name):
            attr = super().__getattribute__(name)
            if name.startswith("_") or not inspect.ismethod(attr):
                return attr

            def call(*args, **kwargs):
                deadline = time.monotonic() + 30
                while True:
                    try:
                        return attr(*args, **kwargs)
                    except OperationalError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.2)
            return call

    pg_url = private_pg.url
    store = Patient(pg_url)
    verdict = check(tiny_spec("restarts", trials=4, strategy="grid", trial_min_time_s=1.0), Settings())
    job_id = store.create_job(**verdict.job).id
    # a lease that outlasts an outage: FAST_LEASES' 3 s ran out while PostgreSQL took longer than that to come back
    # beside a busy process, and the job was handed back and claimed again (attempts 2), which is the lease doing
    # its job, not the worker failing to ride the outage out
    env = {**os.environ, **FAST_LEASES, "SLTUNE_LEASE_SECONDS": "60", "SLTUNE_DB_RETRY_S": "30",
           "SLTUNE_DATA_DIR": str(tmp_path / "data")}
    worker = Proc(["worker", "--db", pg_url], env, tmp_path / "worker.log")
    try:
        outages = []
        for number in (1, 2):          # each restart while a trial runs
            deadline = time.monotonic() + 120
            while not any(t.number >= number and t.status == "running" for t in store.trials(job_id)):
                assert time.monotonic() < deadline and worker.p.poll() is None, worker.output()[-3000:]
                time.sleep(0.1)
            outages.append(private_pg.restart(down_s=1.5))
        deadline = time.monotonic() + 120
        while (job := store.job(job_id)).status in ("queued", "running"):
            assert time.monotonic() < deadline and worker.p.poll() is None, worker.output()[-3000:]
            time.sleep(0.2)
        assert worker.p.poll() is None, worker.output()[-3000:]           # the worker lived through both
        assert job.status == "succeeded" and job.error is None and job.attempts == 1, (job.status, job.error)
        trials = store.trials(job_id)
        assert [t.number for t in trials] == [0, 1, 2, 3], [(t.number, t.status) for t in trials]
        assert all(t.status in ("ok", "oom") for t in trials), [t.status for t in trials]
        out = worker.output()
        assert "retrying" in out or "cannot check" in out, (outages, out[-3000:])      # the restarts did hit it
    finally:
        worker.kill()
