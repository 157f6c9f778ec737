"""Issue #47, items 1 and 2: a server reads a model folder only inside its models_dir when the bytes are read (the
worker, each trial, an export), not only when the job is submitted; and no model.path is a 500. Real `sltune serve`
and `sltune worker` processes on a SQLite file, real trials."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from sltune.models import build, load_config, with_layers
from tests.support.servers import wait_for
from tests.support.specs import tiny_spec

OUTSIDE_LAYERS = 7          # the outside model's depth: a trial that read it would report it


def save_model(folder: Path, layers: int) -> None:
    build(with_layers(load_config("llama-tiny"), layers)).save_pretrained(folder)


def spec(path: str) -> dict:
    return {**tiny_spec(trials=2), "model": {"path": path}}


def read_marks(folder: Path) -> dict[str, float]:
    """Each file's atime, set older than its mtime first: on a relatime mount (the default) any read of the file
    then moves its atime to now, so an unchanged atime shows the file was not read."""
    marks = {}
    for f in sorted(folder.iterdir()):
        st = f.stat()
        os.utime(f, (st.st_mtime - 3600, st.st_mtime))
        marks[f.name] = f.stat().st_atime
    return marks


def test_a_folder_swapped_after_submission_fails_the_job_in_one_line_and_nothing_outside_is_read(services, tmp_path):
    models, outside = tmp_path / "models", tmp_path / "elsewhere" / "m7"
    save_model(models / "swap", 4)
    save_model(outside, OUTSIDE_LAYERS)
    control = tmp_path / "elsewhere" / "control.txt"
    control.write_text("read me")
    before = read_marks(outside)
    mark = read_marks(control.parent)["control.txt"]
    control.read_bytes()
    assert control.stat().st_atime > mark, "this filesystem does not record reads in atime; the test cannot see them"

    services.env["SLTUNE_MODELS_DIR"] = str(models)
    services.serve()                     # no worker: the job waits in the queue meanwhile
    with services.client() as c:
        r = c.post("/tune", json=spec("swap"))
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]

        shutil.rmtree(models / "swap")
        (models / "swap").symlink_to(outside)
        del services.env["SLTUNE_MODELS_DIR"]       # the worker knows no models_dir: the job's record confines it
        services.worker()
        job = wait_for(c, job_id)
        trials = c.get(f"/jobs/{job_id}/trials").json()

    assert job["status"] == "failed", job
    error = job["error"]
    assert "\n" not in error and "config.json now leads outside this server's models_dir" in error, error
    assert str(outside) not in error and "elsewhere" not in error           # where it leads is not told
    assert not any((t.get("result") or {}).get("config", {}).get("num_layers") == OUTSIDE_LAYERS for t in trials)
    after = {f.name: f.stat().st_atime for f in sorted(outside.iterdir())}
    assert after == before, "a file outside models_dir was read"
    assert job["limits"]["model.path"] == {"requested": "swap", "applied": str(models.resolve() / "swap"),
                                           "by": "server", "models_dir": str(models.resolve())}


def test_a_trial_and_an_export_read_only_inside_models_dir(services, tmp_path):
    """The trial's own reads (a folder swapped while its job runs) and GET /jobs/{id}/config.yaml's, each checked
    where the file is opened: a trial fails naming models_dir; the export answers 409 naming it."""
    from sltune.profiling import run_trial
    from sltune.profiling.schema import TrialSpec

    models, outside = tmp_path / "models", tmp_path / "elsewhere" / "m7"
    save_model(models / "kept", 4)
    save_model(outside, OUTSIDE_LAYERS)
    (models / "link").symlink_to(outside)
    trial = TrialSpec(model=str(models / "link"), seq_len=32, steps=1, min_time_s=0, profile=False,
                      models_dir=str(models))
    unconfined = run_trial(trial.model_copy(update={"models_dir": None}))   # `sltune profile` on one's own folder
    assert unconfined.status == "ok" and unconfined.config.num_layers == OUTSIDE_LAYERS
    before = read_marks(outside)
    result = run_trial(trial)
    assert result.status == "failed" and "config.json now leads outside this server's models_dir" in result.error
    assert {f.name: f.stat().st_atime for f in sorted(outside.iterdir())} == before

    services.env["SLTUNE_MODELS_DIR"] = str(models)
    services.serve(worker=True)
    with services.client() as c:
        r = c.post("/tune", json=spec("kept"))
        assert r.status_code == 202, r.text
        job = wait_for(c, r.json()["job_id"])
        assert job["status"] == "succeeded", job
        assert c.get(f"/jobs/{job['id']}/config.yaml").status_code == 200
        before = read_marks(outside)
        shutil.rmtree(models / "kept")
        (models / "kept").symlink_to(outside)
        r = c.get(f"/jobs/{job['id']}/config.yaml")
    assert r.status_code == 409 and "now leads outside this server's models_dir" in r.json()["detail"], r.text
    assert {f.name: f.stat().st_atime for f in sorted(outside.iterdir())} == before


@pytest.mark.parametrize("path, says", [
    ("a" * 300, "a name in it is 300 bytes long, more than the 255 a file name may have"),
    ("/".join(["b" * 200] * 25), "more than the 4095 a path may have"),
    ("swap\x00/config.json", "it holds a NUL byte, which no path can"),
], ids=["300-byte-name", "5000-byte-path", "nul-byte"])
def test_a_path_no_system_can_hold_is_a_422_naming_model_path(api_with_models_dir, path, says):
    r = api_with_models_dir.post("/tune", json=spec(path))
    assert r.status_code == 422, r.text
    (entry,) = r.json()["detail"]
    assert entry["loc"] == ["body", "model", "path"] and entry["msg"].startswith("model.path: "), entry
    assert says in entry["msg"] and "models_dir (relative to it, or absolute)" in entry["msg"], entry


@pytest.fixture(scope="module")
def api_with_models_dir(tmp_path_factory):
    from tests.support.servers import Services

    tmp = tmp_path_factory.mktemp("paths")
    (tmp / "models").mkdir()
    svc = Services(tmp, f"sqlite:///{tmp / 'jobs.db'}")
    svc.env["SLTUNE_MODELS_DIR"] = str(tmp / "models")
    svc.serve()
    with svc.client() as c:
        yield c
    svc.stop()


def test_json_null_is_called_null_in_a_refusal(api_with_models_dir):
    """Issue #47, item 4: `"backend": null` is refused as JSON says it, not as Python's None."""
    body = tiny_spec()
    body["search"]["backend"] = None
    r = api_with_models_dir.post("/tune", json=body)
    assert r.status_code == 422, r.text
    assert [e["msg"] for e in r.json()["detail"]] == [
        "search.backend: null is not a backend or a list of them; give speedloader, deepspeed, fsdp or a list such as "
        "[speedloader, fsdp]"]
