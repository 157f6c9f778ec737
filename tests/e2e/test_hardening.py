"""The service under hostile requests, on SQLite and on PostgreSQL: server ceilings no request lifts, 4xx
(never 5xx) for NUL bytes, NaN, Infinity and out-of-range numbers, and an API that stays responsive
while heavy specs are being checked."""

import statistics
import threading
import time

import httpx
import psutil
import pytest

from tests.support.servers import Services, TOKEN
from tests.support.specs import tiny_spec

FRACTION = 0.1      # a ceiling a tiny model's trial fits under (a trial process alone holds about 0.35 GiB), so
                    # that a spec below it is admitted, not refused as predicted over it


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def api(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "sqlite":
        db = f"sqlite:///{tmp / 'jobs.db'}"
    else:
        db = request.getfixturevalue("pg_module_url")
    svc = Services(tmp, db)
    svc.env.update(SLTUNE_TRIAL_HOST_MEMORY_FRACTION=str(FRACTION), SLTUNE_MAX_DEVICE_MEMORY="64MiB",
                   SLTUNE_MAX_TRIAL_STEPS="50")
    svc.serve()
    yield svc
    svc.stop()


def test_a_request_above_a_ceiling_is_clamped_or_refused_and_the_job_says_which(api):
    ceiling = int(psutil.virtual_memory().total * FRACTION)
    with api.client() as c:
        spec = tiny_spec("greedy")
        spec["hardware"] = {"host_memory_limit": "1000TiB", "device_memory_limit": "1TiB"}
        r = c.post("/tune", json=spec)
        assert r.status_code == 202, r.text
        job = c.get(f"/jobs/{r.json()['job_id']}").json()
        assert job["spec"]["hardware"]["host_memory_limit"] == ceiling
        assert job["spec"]["hardware"]["device_memory_limit"] == 64 * 2**20
        assert job["limits"]["hardware.host_memory_limit"] == {"requested": 1000 * 2**40, "applied": ceiling,
                                                               "by": "server"}
        assert job["limits"]["search.max_trials"]["by"] == "request"

        modest = tiny_spec("modest")
        modest["hardware"] = {"host_memory_limit": "600MiB", "device_memory_limit": "3MiB"}
        job = c.get(f"/jobs/{c.post('/tune', json=modest).json()['job_id']}").json()
        assert job["limits"]["hardware.host_memory_limit"] == {"requested": 600 * 2**20, "applied": 600 * 2**20,
                                                               "by": "request"}
        tight = tiny_spec("tight")      # below what a trial process holds: every trial would be killed as oom
        tight["hardware"] = {"host_memory_limit": "100MiB"}
        r = c.post("/tune", json=tight)
        assert r.status_code == 422 and "hardware.host_memory_limit 100.0 MiB is below the" in r.text, r.text

        unnamed = c.get(f"/jobs/{c.post('/tune', json=tiny_spec('unnamed')).json()['job_id']}").json()
        assert unnamed["limits"]["hardware.host_memory_limit"]["applied"] == ceiling

        for field, value in (("trial_steps", 51), ("max_trials", 10_000), ("trial_timeout_s", 1e6),
                             ("time_budget_s", 1e9)):
            r = c.post("/tune", json=tiny_spec(**{field: value}))
            assert r.status_code == 422, (field, r.text)
            assert r.json()["detail"][0]["msg"].startswith(f"search.{field}: ") and "server's limit" in r.text


def test_nul_nan_infinity_and_out_of_range_numbers_get_4xx(api):
    with api.client() as c:
        for path in ("/jobs/%00", "/jobs/a%00b/trials", "/jobs/%00/config.yaml", "/dashboard/jobs/%00",
                     "/jobs/%00/trials/1/trace"):
            assert c.get(path).status_code == 404, path
        assert c.post("/jobs/%00/cancel").status_code == 404
        for query in ("status=%00", "status=queued%00", "limit=1%00"):
            r = c.get(f"/jobs?{query}")
            assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("query:"), query
        assert c.get("/dashboard?status=%00").status_code == 422
        for bad in ("NaN", "Infinity", "-Infinity"):
            body = f'{{"model": {{"preset": "llama-tiny"}}, "search": {{"time_budget_s": {bad}}}}}'
            r = c.post("/tune", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 422 and bad in r.json()["detail"][0]["msg"], r.text
        for seed in (-1, 2**32, 2**70):
            r = c.post("/tune", json=tiny_spec(seed=seed))
            assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("search.seed: "), r.text
        r = c.post("/tune", json=tiny_spec(seed=2**32 - 1))
        assert r.status_code == 202, r.text
        r = c.post("/tune", json={**tiny_spec(), "search": {"max_trails": 3}})
        assert r.json()["detail"] == [{"loc": ["body", "search", "max_trails"], "type": "value_error",
                                       "msg": "search.max_trails: unknown field; check its spelling against "
                                              "the spec reference (docs/reference/spec.md)"}]
        r = c.post("/tune", json={"model": {"hf_config": {"model_type": "llama", "num_hidden_layers": 1000,
                                                          "hidden_size": 60000, "intermediate_size": 200000,
                                                          "num_attention_heads": 1000}}})
        assert r.status_code == 422 and "parameters, more than" in r.text
        r = c.post("/tune", json={"model": {"hf_config": {"model_type": "llama", "head_dim": 10**9}}})
        assert r.status_code == 422 and "head_dim" in r.text


# on SQLite's server alone: /healthz answers from what its thread last found (sltune.service.health), and a refused spec
# never reaches the store, so the database is nothing to this test, and the checks are its costliest minute
@pytest.mark.parametrize("api", ["sqlite"], indirect=True)
def test_healthz_answers_within_200ms_while_6_heavy_specs_are_checked(api):
    def heavy(i: int) -> dict:    # 160 layers on the meta device: most of a second of pure Python each
        return {"name": f"heavy-{i}", "model": {"hf_config": {"model_type": "gpt2", "n_layer": 160, "n_embd": 1024,
                                                              "n_head": 16, "vocab_size": 60_000 + i}}}

    answers = []

    def post(i: int) -> None:
        with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
            r = c.post("/tune", json=heavy(i))
            answers.append((r.status_code, r.json()["detail"][0]["msg"][:9]))

    posters = [threading.Thread(target=post, args=(i,)) for i in range(6)]
    for t in posters:
        t.start()
    latencies = []
    with httpx.Client(base_url=api.url, timeout=5) as c:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            start = time.perf_counter()
            assert c.get("/healthz").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
    for t in posters:
        t.join(120)
    # each was checked in full: its shape built, then its host memory found above this server's ceiling
    assert answers == [(422, "hardware:")] * 6, answers
    # A check held on the event loop (most of a second each) keeps every probe behind it slow. One probe alone
    # can be slow because a busy machine descheduled the server or this test (327 and 337 ms beside a busy loop
    # in CI, the median 6-11 ms): never two in a row, and at most one in ten.
    slow = [i for i, t in enumerate(latencies) if t >= 0.2]
    said = (statistics.median(latencies), max(latencies), len(slow), len(latencies))
    assert len(latencies) >= 10 and not any(i + 1 in slow for i in slow), said
    assert len(slow) <= len(latencies) // 10, said


@pytest.mark.parametrize("token", ["", "  ", "\n"])
def test_a_blank_token_is_no_token(token, monkeypatch, capsys):
    from sltune.cli.main import main
    from sltune.settings import Settings

    monkeypatch.setenv("SLTUNE_API_TOKEN", token)
    assert Settings().api_token is None
    assert main(["serve", "--host", "0.0.0.0", "--port", "1"]) == 2     # refused: no token, not loopback
    assert "without SLTUNE_API_TOKEN" in capsys.readouterr().err


def test_a_worker_holds_each_trial_to_its_own_host_ceiling_whatever_the_stored_spec_says():
    from sltune.tuning.search.trials import trial_spec
    from sltune.tuning.space import Candidate
    from sltune.tuning.spec import TuningSpec

    def host_limit(asked: str | None, ceiling: int | None) -> int | None:
        spec = TuningSpec.model_validate({**tiny_spec(), "hardware": {"host_memory_limit": asked}})
        return trial_spec(spec, Candidate(1, 1, 1), None, default_host_limit=ceiling).host_memory_limit

    assert host_limit("1000TiB", 2**30) == 2**30
    assert host_limit("512MiB", 2**30) == 2**29
    assert host_limit(None, 2**30) == 2**30
    assert host_limit("512MiB", None) == 2**29


def test_api_docs_are_served_without_a_cdn(api):
    with httpx.Client(base_url=api.url, timeout=30) as c:
        for page, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
            html = c.get(page).text
            assert "://" not in html and asset in html, html[:500]      # nothing from another host
            src = next(part.split('"')[0] for part in html.split('src="')[1:] if asset in part.split('"')[0])
            js = c.get(src)
            assert js.status_code == 200 and len(js.content) > 100_000, (src, js.status_code)


def test_model_path_is_read_only_inside_the_servers_models_dir(tmp_path):
    """POST /tune's check (sltune.service.validation.check, what the pool runs) before anything reads the path:
    no models_dir, no path at all; outside it, with '..' or a symlink leading out, refused naming models_dir;
    inside it (relative to it, or absolute) the job runs the folder's absolute path."""
    from sltune.models import build
    from sltune.service.validation import check
    from sltune.settings import Settings

    models, outside = tmp_path / "models", tmp_path / "elsewhere"
    build("llama-tiny").config.save_pretrained(models / "tiny")
    build("llama-tiny").config.save_pretrained(outside)
    (models / "link").symlink_to(outside)
    spec = {k: v for k, v in tiny_spec().items() if k != "model"}

    def verdict(path: str, models_dir=models):
        return check({**spec, "model": {"path": path}}, Settings(models_dir=models_dir))

    assert verdict("tiny", models_dir=None).errors == [("model.path", (
        "this server has no models_dir, so it reads no model folder a request names; give model.preset or "
        "model.hf_config, or ask its operator to set SLTUNE_MODELS_DIR (sltune serve --models-dir)"))]
    for path in (str(outside), "../elsewhere", "tiny/../../elsewhere", "link", "/etc"):
        errors = verdict(path).errors
        assert errors and errors[0][0] == "model.path" and "outside this server's models_dir" in errors[0][1], path
        assert str(tmp_path) not in errors[0][1]          # the server's own paths stay its own
    for path in ("tiny", str(models / "tiny"), "./tiny/../tiny"):
        job = verdict(path).job
        assert job is not None and job["spec"]["model"]["path"] == str((models / "tiny").resolve()), path
    assert verdict("nothing-here").errors == [("model.path", "no such folder; give a Hugging Face model folder "
                                               "(config.json, and model.safetensors or its shards for the weights)")]
    assert Settings(models_dir="").models_dir is None
