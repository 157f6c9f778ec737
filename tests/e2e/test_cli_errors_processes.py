"""A database that is not there (or a server that does not answer), said in one line by every command that
opens one, `tune`, `worker` and `serve` as real processes; and `sltune profile --mode generate` as a
process, without transformers' deprecation warnings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.engine import make_url

from sltune.cli.main import main
from sltune.store import Store
from sltune.store.db import normalize_url
from sltune.store.faults import is_transient, retrying
from tests.support.cli import sltune
from tests.support.servers import free_port
from tests.support.specs import tiny_spec


def one_error_line(err: str, command: str) -> str:
    """The one `sltune COMMAND: error:` line of a stderr, checked to be its last and the only one, with no
    traceback or usage before it (a progress bar's frames may come first)."""
    assert "Traceback" not in err and "usage:" not in err, err
    lines = [line for line in err.splitlines() if f"sltune {command}: error:" in line]
    assert len(lines) == 1 and err.rstrip("\n").splitlines()[-1] == lines[0], err
    return lines[0]


# -- 1. a database that cannot be opened as given ------------------------------------------------------------

@pytest.fixture
def missing_db(pg_server_url):
    """The URL of a database that does not exist on the test server (and its parts)."""
    name = f"nc_missing_{uuid.uuid4().hex[:8]}"
    url = make_url(pg_server_url).set(database=name)
    return url.render_as_string(hide_password=False), name, url


def createdb(url) -> str:
    port = f" -p {url.port}" if url.port not in (None, 5432) else ""
    return f"createdb -h {url.host}{port} -U {url.username} {url.database}"


def test_a_missing_postgresql_database_is_one_line_naming_the_flag_and_the_createdb_command(missing_db, capsys,
                                                                                            monkeypatch):
    url, name, parsed = missing_db
    expected = (f'--db/SLTUNE_DB {url}: database "{name}" does not exist; create it with: {createdb(parsed)}\n')
    for command in (["export", "somejob", "--db", url], ["compare", "a", "b", "--db", url]):
        assert main(command) == 2
        assert capsys.readouterr().err == f"sltune {command[0]}: error: {expected}"
    monkeypatch.setenv("SLTUNE_DB", url)              # the same database named by the environment
    assert main(["export", "somejob"]) == 2
    assert capsys.readouterr().err == f"sltune export: error: {expected}"


def test_tune_worker_and_serve_say_the_same_one_line_for_a_missing_database(missing_db, tmp_path):
    """The message comes from where the store is opened, so every command (and serve's own worker) says it."""
    url, name, parsed = missing_db
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec("nc-missing", trials=1)))
    env = {**os.environ, "SLTUNE_DATA_DIR": str(tmp_path / "data")}
    commands = {"tune": ["tune", str(spec), "--db", url], "worker": ["worker", "--db", url],
                "serve": ["serve", "--no-worker", "--port", str(free_port()), "--db", url]}
    procs = {name_: subprocess.Popen([sys.executable, "-m", "sltune", *argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env)
             for name_, argv in commands.items()}          # side by side: each imports torch for ~10 s
    for command, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err
        assert one_error_line(err, command) == (f'sltune {command}: error: --db/SLTUNE_DB {url}: database "{name}" '
                                                f"does not exist; create it with: {createdb(parsed)}")


def test_a_server_that_refuses_an_unknown_host_and_an_unknown_role_are_one_line_each(pg_server_url, capsys):
    closed = f"postgresql://postgres@127.0.0.1:{free_port()}/test"
    assert main(["export", "somejob", "--db", closed]) == 2
    host, port = closed.split("@")[1].split("/")[0].split(":")
    assert capsys.readouterr().err == (
        f"sltune export: error: --db/SLTUNE_DB {closed}: no PostgreSQL server accepts connections at {host} port "
        f"{port} (connection refused); start it, or fix the host and port in the URL\n")

    unknown = "postgresql://postgres@nc-no-such-host.invalid/test"
    assert main(["export", "somejob", "--db", unknown]) == 2
    assert capsys.readouterr().err == (
        f"sltune export: error: --db/SLTUNE_DB {unknown}: host 'nc-no-such-host.invalid' is unknown (its name does "
        f"not resolve); fix the host in the URL\n")

    nobody = make_url(pg_server_url).set(username="nc_nobody")
    shown = nobody.render_as_string(hide_password=True)
    assert main(["export", "somejob", "--db", nobody.render_as_string(hide_password=False)]) == 2
    assert capsys.readouterr().err == (
        f'sltune export: error: --db/SLTUNE_DB {shown}: role "nc_nobody" does not exist on the server; put an '
        f"existing user in the URL (postgresql://USER@HOST/DB), or create it with: createuser -h {nobody.host}"
        f"{' -p %d' % nobody.port if nobody.port not in (None, 5432) else ''} -U postgres nc_nobody\n")


def test_a_missing_database_is_not_retried_but_a_failure_of_a_running_one_still_is(missing_db):
    """A worker rides out a restart (faults.retrying); a database that does not exist is no restart."""
    url, name, _ = missing_db
    began = time.monotonic()
    with pytest.raises(ValueError, match=f'database "{name}" does not exist') as refused:
        retrying(lambda: Store(url), 10.0)
    assert time.monotonic() - began < 5 and not is_transient(refused.value)
    # a connection the server drops or refuses under a store already open is still worth retrying
    engine = sa.create_engine(normalize_url(f"postgresql://postgres@127.0.0.1:{free_port()}/test"))
    with pytest.raises(sa.exc.OperationalError) as dropped:
        engine.connect()
    assert is_transient(dropped.value)


def test_profile_generate_prints_no_future_warning(tmp_path):
    out = sltune("profile", "--mode", "generate", "--prompt-len", "4", "--new-tokens", "2", "--steps", "1",
                 "--min-time", "0", "--max-steps", "2", "--no-profile",
                 env={"PYTHONWARNINGS": "default", "SLTUNE_DATA_DIR": str(tmp_path / "data")}, process=True)
    assert out.returncode == 0, out.stderr
    assert "trial ok" in out.stdout, out.stdout
    assert "FutureWarning" not in out.stderr and "past_key_values" not in out.stderr, out.stderr


def test_ranks_beyond_the_cores_are_refused_before_any_trial_unless_oversubscribed(tmp_path, monkeypatch):
    """The server's ceiling on world_size applies on the command line too: 8 FSDP ranks of a tune on 2 cores ran, and
    best.yaml said world_size 8. `--oversubscribe` measures it on purpose."""
    from sltune.service.local import fits_this_machine
    from sltune.settings import Settings
    from sltune.tuning.cost.admission import load

    monkeypatch.setenv("SLTUNE_MAX_WORLD_SIZE", "1")        # this machine's ceiling, whatever its cores
    r = sltune("profile", "--world-size", "2", "--steps", "1", "--no-profile", "--json")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("sltune profile: error: --world-size 2 is more ranks than this machine's 1 "
                        "(SLTUNE_MAX_WORLD_SIZE, else its cores): they would take turns on the cores, and the trials "
                        "would measure that; ask for at most 1, or pass --oversubscribe to oversubscribe on purpose\n")
    r = sltune("profile", "--world-size", "2", "--oversubscribe", "--steps", "1", "--min-time", "0", "--no-profile",
               "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config"]["world_size"] == 2

    spec = tmp_path / "spec.yaml"
    spec.write_text((Path(__file__).resolve().parents[2] / "examples" / "tiny-llama-cpu.yaml").read_text()
                    .replace("world_size: 1", "world_size: 2"))
    r = sltune("tune", str(spec), "--db", f"sqlite:///{tmp_path / 'jobs.db'}", process=True,
               env={"SLTUNE_MAX_WORLD_SIZE": "1", "SLTUNE_DATA_DIR": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.startswith("sltune tune: error: hardware.world_size 2 is more ranks than "
                                                     "this machine's 1 (SLTUNE_MAX_WORLD_SIZE, else its cores)")
    assert r.stderr.count("\n") == 1 and "--oversubscribe" in r.stderr
    fits_this_machine(load(spec), Settings(), oversubscribe=True)       # allowed on purpose
