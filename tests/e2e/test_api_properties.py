"""schemathesis with --checks all over every operation of /openapi.json, against a real server: with the
write token and without it; and over POST /tune against a server with a models_dir, where every model.path the
fuzzer invents is looked up (a 4096-byte name was a 500, #47). 0 failures means: no 5xx, every status and media
type documented, responses match their schemas, schema-invalid requests refused, schema-valid ones accepted (save
the spec rules JSON schema cannot express, see tests/support/schemathesis.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import TOKEN, Services

CONFIG = Path(__file__).resolve().parents[1] / "support" / "schemathesis.toml"


@pytest.fixture(scope="module")
def api_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("props")
    svc = Services(tmp, f"sqlite:///{tmp / 'jobs.db'}")
    svc.env.update(SLTUNE_SPEC_CHECK_WORKERS="2", SLTUNE_SPEC_CHECK_TIMEOUT_S="4")   # answers within 10s
    yield svc.serve()          # no worker: submitted jobs stay queued; the API itself is what is tested
    svc.stop()


@pytest.mark.parametrize("token", [TOKEN, None], ids=["with-token", "without-token"])
def test_schemathesis_checks_all_finds_nothing(api_url, token):
    auth = ["-H", f"Authorization: Bearer {token}"] if token else []
    run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
                          f"{api_url}/openapi.json", "--checks", "all", "--max-examples", "15", "--seed", "7",
                          "--no-color", *auth], capture_output=True, text=True, timeout=400)
    summary = run.stdout[run.stdout.rfind("SUMMARY"):]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Selected: 8/8" in summary and " generated" in summary, summary


@pytest.fixture(scope="module")
def models_dir_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("props-models")
    (tmp / "models").mkdir()
    svc = Services(tmp, f"sqlite:///{tmp / 'jobs.db'}")
    svc.env.update(SLTUNE_SPEC_CHECK_WORKERS="2", SLTUNE_SPEC_CHECK_TIMEOUT_S="4", SLTUNE_MODELS_DIR=str(tmp / "models"))
    yield svc.serve()
    svc.stop()


def test_schemathesis_finds_nothing_in_post_tune_against_a_models_dir(models_dir_url):
    """Its coverage phase posts a model.path at the schema's maxLength (4096 bytes in one name) among ~1,000 cases:
    against the server before #47 this run reported ST101 Server error (500: OSError, File name too long)."""
    run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
                          f"{models_dir_url}/openapi.json", "--checks", "all", "--max-examples", "100", "--seed", "7",
                          "--include-path", "/tune", "--phases", "examples,coverage,fuzzing", "--no-color",
                          "-H", f"Authorization: Bearer {TOKEN}"], capture_output=True, text=True, timeout=400)
    summary = run.stdout[run.stdout.rfind("SUMMARY"):]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Selected: 1/8" in summary and " generated" in summary, summary
