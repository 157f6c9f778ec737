"""schemathesis with --checks all over every operation of /openapi.json, against a real server: with the
write token and without it, against a server with a models_dir, where every model.path the fuzzer invents is looked
up (a 4096-byte name was a 500); and the coverage phase of POST /tune alone, which posts one. 0 failures means: no
5xx, every status and media type documented, responses match their schemas, schema-invalid requests refused,
schema-valid ones accepted (save the spec rules JSON schema cannot express, see tests/support/schemathesis.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import TOKEN, Services

CONFIG = Path(__file__).resolve().parents[1] / "support" / "schemathesis.toml"


@pytest.fixture(scope="module")
def api_url(tmp_path_factory):
    """One server for every run, with a models_dir: every model.path the fuzzer invents is looked up in it."""
    tmp = tmp_path_factory.mktemp("props")
    (tmp / "models").mkdir()
    svc = Services(tmp, f"sqlite:///{tmp / 'jobs.db'}")
    svc.env.update(SLTUNE_SPEC_CHECK_WORKERS="2", SLTUNE_SPEC_CHECK_TIMEOUT_S="4",      # answers within 10s
                   SLTUNE_MODELS_DIR=str(tmp / "models"))
    yield svc.serve()          # no worker: submitted jobs stay queued; the API itself is what is tested
    svc.stop()


def schemathesis(url: str, *flags: str) -> str:
    """One schemathesis run with --checks all against `url`'s /openapi.json: its summary, asserted to have passed."""
    run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
                          f"{url}/openapi.json", "--checks", "all", "--seed", "7", "--no-color", *flags],
                         capture_output=True, text=True, timeout=400)
    summary = run.stdout[run.stdout.rfind("SUMMARY"):]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " generated" in summary, summary
    return summary


@pytest.mark.parametrize("token", [TOKEN, None], ids=["with-token", "without-token"])
def test_schemathesis_checks_all_finds_nothing(api_url, token):
    auth = ["-H", f"Authorization: Bearer {token}"] if token else []
    assert "Selected: 8/8" in schemathesis(api_url, "--max-examples", "15", *auth)


def test_schemathesis_s_coverage_of_post_tune_finds_nothing_against_a_models_dir(api_url):
    """The coverage phase posts a model.path at the schema's bounds (4096 bytes in one name): against the server
    before model paths were checked for their length this reported ST101 Server error (500: OSError, File name too
    long)."""
    summary = schemathesis(api_url, "--include-path", "/tune", "--phases", "coverage", "-H",
                           f"Authorization: Bearer {TOKEN}")
    assert "Selected: 1/8" in summary
