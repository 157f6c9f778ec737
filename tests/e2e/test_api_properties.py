"""schemathesis with --checks all over every operation of /openapi.json, against a real server: with the
write token and without it. 0 failures means: no 5xx, every status and media type documented, responses
match their schemas, schema-invalid requests refused, schema-valid ones accepted (save the spec rules
JSON schema cannot express, see tests/support/schemathesis.toml)."""

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
