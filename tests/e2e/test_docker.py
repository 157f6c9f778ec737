"""docker/Dockerfile and docker/compose.yaml, checked without a Docker engine: parsed, and every sltune command
they run checked against the real CLI; the image's health check is run against a real server."""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from sltune.cli.main import parser
from sltune.store.db import normalize_url

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"


# -- a small Dockerfile parser -----------------------------------------------------------------------
def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, backslash continuations joined."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue                                   # a comment inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "the Dockerfile ends inside a continued line"
    return out


def args_of(ins, name: str) -> list[str]:
    return [a for n, a in ins if n == name]


def exec_form(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
    return value


def build_args(ins) -> dict[str, str | None]:
    out = {}
    for a in args_of(ins, "ARG"):
        name, eq, default = a.partition("=")
        out[name] = default if eq else None
    return out


def sltune_command(argv: list[str]) -> None:
    """argv (after `sltune`) must parse with the real CLI, and `python -m sltune SUB --help` must run."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as err:                       # argparse's way of saying no
        raise AssertionError(f"`sltune {' '.join(argv)}` is not a valid sltune command line") from err
    assert callable(args.run)
    usage = subcommand_help(argv[0])
    for flag in (a for a in argv if a.startswith("--")):
        assert flag in usage, f"{flag} is not in `sltune {argv[0]} --help`"


@functools.lru_cache(maxsize=None)
def subcommand_help(sub: str) -> str:
    out = subprocess.run([sys.executable, "-m", "sltune", sub, "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and f"usage: sltune {sub}" in out.stdout, out.stderr
    return out.stdout


def test_dockerfile_is_cpu_by_default_and_selects_cuda_by_build_args():
    ins = instructions()
    names = [n for n, _ in ins]
    assert set(names) <= {"FROM", "ARG", "ENV", "RUN", "WORKDIR", "COPY", "USER", "VOLUME", "EXPOSE", "HEALTHCHECK",
                          "ENTRYPOINT", "CMD", "LABEL"}
    assert names[0] == "ARG" and names.count("FROM") == 1
    before_from = build_args(ins[:names.index("FROM")])
    assert before_from["BASE"] == "python:3.11-slim"
    assert args_of(ins, "FROM") == ["${BASE}"]
    args = build_args(ins)
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH_VERSION"] == "2.13.0"
    # the image and CI (and the README's commands) test the same torch: the one install pins it
    assert f"torch=={args['TORCH_VERSION']}" in (ROOT / "scripts" / "install.sh").read_text()
    torch_runs = [r for r in args_of(ins, "RUN") if "torch==" in r]
    assert len(torch_runs) == 1
    assert '--index-url "${TORCH_INDEX}"' in torch_runs[0] and '"torch==${TORCH_VERSION}"' in torch_runs[0]
    # the project is installed after torch, so pip keeps the build torch came from
    runs = args_of(ins, "RUN")
    install = next(i for i, r in enumerate(runs) if re.search(r'pip install "?/src\b', r))
    assert install > runs.index(torch_runs[0])


def test_dockerfile_copies_every_package_folder_and_runs_as_a_non_root_user():
    ins = instructions()
    copied = " ".join(args_of(ins, "COPY")).split()
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # every package sits under sltune/ (no package-dir mapping), so copying it copies them all
    folders = {name.split(".")[0] for name in meta["tool"]["setuptools"]["packages"]}
    assert folders == {"sltune"} and "package-dir" not in meta["tool"]["setuptools"]
    for need in ["pyproject.toml", meta["project"]["readme"], *sorted(folders)]:
        assert need in copied, f"the Dockerfile does not COPY {need}"
        assert (ROOT / need).exists()
    users = args_of(ins, "USER")
    assert users and users[-1] not in ("root", "0")
    assert any("useradd" in r and users[-1] in r for r in args_of(ins, "RUN"))
    assert [n for n, _ in ins].index("USER") < [n for n, _ in ins].index("ENTRYPOINT")
    env = " ".join(args_of(ins, "ENV"))
    assert "SLTUNE_DATA_DIR=/data" in env and args_of(ins, "VOLUME") == ['["/data"]']
    # nothing the image needs is kept out of the build context
    ignore = ROOT / ".dockerignore"
    if ignore.exists():
        patterns = [p.strip() for p in ignore.read_text().splitlines() if p.strip() and not p.startswith("#")]
        for need in ["pyproject.toml", meta["project"]["readme"], *folders, "docker/Dockerfile"]:
            assert not any(fnmatch.fnmatch(need, p) for p in patterns), f".dockerignore excludes {need}"
        assert ".git" in patterns


def test_entrypoint_command_and_every_sltune_call_are_real_cli_commands():
    ins = instructions()
    assert exec_form(args_of(ins, "ENTRYPOINT")[-1]) == ["sltune"]
    cmd = exec_form(args_of(ins, "CMD")[-1])
    assert cmd == ["serve", "--host", "0.0.0.0"]
    assert args_of(ins, "EXPOSE") == ["8000"]
    sltune_command(cmd)
    assert any("sltune --help" in r for r in args_of(ins, "RUN"))      # a build-time smoke test


def healthcheck_code(text: str) -> tuple[list[str], str]:
    """The options and the python -c code of a HEALTHCHECK (exec form)."""
    opts, _, rest = text.partition("CMD ")
    argv = exec_form(rest)
    assert argv[:2] == ["python", "-c"], argv
    return opts.split(), argv[2]


def test_healthcheck_hits_healthz_and_passes_only_against_a_live_server(services):
    opts, code = healthcheck_code(args_of(instructions(), "HEALTHCHECK")[-1])
    assert {o.split("=")[0] for o in opts} >= {"--interval", "--timeout", "--start-period", "--retries"}
    assert "/healthz" in code
    compose_code = load_compose()["services"]["api"]["healthcheck"]["test"]
    assert compose_code[:3] == ["CMD", "python", "-c"] and "/healthz" in compose_code[3]

    url = services.serve()
    port = url.rsplit(":", 1)[1]
    env = {**os.environ, "SLTUNE_PORT": port}
    ok = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    ok = subprocess.run([sys.executable, "-c", compose_code[3].replace("8000", port)], capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    services.stop()
    dead = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert dead.returncode != 0


# -- compose.yaml -----------------------------------------------------------------------------------
def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())          # the x-sltune anchor is merged in by <<


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error}, as `docker compose` resolves them."""
    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":-":
            return arg
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return ""
    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", one, value)


ENV = {"SLTUNE_API_TOKEN": "secret"}


def test_compose_has_api_workers_and_postgres_on_one_database():
    c = load_compose()
    services = c["services"]
    assert {name for name, svc in services.items() if "profiles" not in svc} == {"api", "worker", "postgres"}
    api, worker, pg = services["api"], services["worker"], services["postgres"]

    api_cmd = [interpolate(a, ENV) for a in api["command"]]
    worker_cmd = [interpolate(a, ENV) for a in worker["command"]]
    assert api_cmd[:3] == ["serve", "--host", "0.0.0.0"] and "--no-worker" in api_cmd
    assert worker_cmd[0] == "worker"
    db = api_cmd[api_cmd.index("--db") + 1]
    assert worker_cmd[worker_cmd.index("--db") + 1] == db          # one database for all
    assert db.startswith("postgresql://") and normalize_url(db).startswith("postgresql+psycopg://")
    from sqlalchemy.engine import make_url

    u = make_url(normalize_url(db))
    assert u.host == "postgres" and u.port == 5432
    pg_env = pg["environment"]
    assert (u.username, u.database) == (pg_env["POSTGRES_USER"], pg_env["POSTGRES_DB"])
    assert u.password == interpolate(pg_env["POSTGRES_PASSWORD"], ENV)
    sltune_command(api_cmd)
    sltune_command(worker_cmd)

    # the API is published; workers scale with --scale worker=N: no fixed name or host port
    assert any(str(p).endswith(":8000") for p in api["ports"])
    assert "container_name" not in worker and "ports" not in worker
    assert pg["image"].startswith("postgres:")


def test_compose_env_volumes_healthchecks_and_start_order():
    c = load_compose()
    s = c["services"]
    for name in ("api", "worker"):
        svc = s[name]
        assert svc["build"]["dockerfile"] == "docker/Dockerfile"
        assert (COMPOSE.parent / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DOCKERFILE
        env = svc["environment"]
        assert env["SLTUNE_API_TOKEN"].startswith("${SLTUNE_API_TOKEN")            # from the environment
        with pytest.raises(KeyError):
            interpolate(env["SLTUNE_API_TOKEN"], {})                             # and required
        assert env["SLTUNE_DATA_DIR"] == "/data"
        assert "artifacts:/data" in svc["volumes"]                                 # shared traces
        assert "models:/models" in svc["volumes"] and env["SLTUNE_MODELS_DIR"] == "/models"    # and model folders
        assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert s["worker"]["depends_on"]["api"]["condition"] == "service_healthy"
    assert s["worker"]["healthcheck"] == {"disable": True}
    assert s["api"]["healthcheck"]["test"][0] == "CMD"
    pg = s["postgres"]
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert any(v.startswith("pgdata:") and v.endswith("/var/lib/postgresql/data") for v in pg["volumes"])
    assert set(c["volumes"]) == {"pgdata", "artifacts", "models"}


def ray_command(argv: list[str]) -> None:
    """argv (after `ray`) is `ray start` with flags Ray's real CLI has."""
    assert argv[0] == "start", argv
    usage = subprocess.run([Path(sys.executable).with_name("ray"), "start", "--help"], capture_output=True, text=True,
                           timeout=120).stdout
    for flag in (a for a in argv if a.startswith("--")):
        assert f"  {flag}" in usage, f"{flag} is not in `ray start --help`"


def test_compose_s_ray_profile_is_a_head_nodes_and_a_worker_on_one_image_with_ray():
    """--profile ray: a head that runs no trial, nodes that join it (trials at the default priority, the models
    volume at the worker's path), a worker pointed at the head on the database the others use; one image built with
    the extra ray, so the pre-flight finds the same versions everywhere."""
    pytest.importorskip("ray", reason="Ray is the optional extra ray: pip install -e '.[ray]'")
    c = load_compose()
    s = c["services"]
    ray_side = {name for name, svc in s.items() if svc.get("profiles") == ["ray"]}
    assert ray_side == {"ray-head", "ray-node", "worker-ray"}
    for name in ray_side:
        assert s[name]["build"]["args"] == {"EXTRAS": "ray"} and s[name]["image"] == "sltune:ray"
        assert (COMPOSE.parent / s[name]["build"]["context"] / s[name]["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert build_args(instructions())["EXTRAS"] == '""'
    head, node, worker = s["ray-head"], s["ray-node"], s["worker-ray"]
    assert head["entrypoint"] == node["entrypoint"] == ["ray"]
    ray_command(head["command"])
    ray_command(node["command"])
    port = head["command"][head["command"].index("--port") + 1]
    assert head["command"][head["command"].index("--num-cpus") + 1] == "0" and "--head" in head["command"]
    assert node["command"][node["command"].index("--address") + 1] == f"ray-head:{port}"
    assert worker["environment"]["SLTUNE_RAY_ADDRESS"] == f"ray-head:{port}"
    assert node["environment"]["RAY_worker_niceness"] == "0"
    assert node["healthcheck"] == worker["healthcheck"] == {"disable": True}     # no /healthz to poll there
    assert "models:/models" in node["volumes"] and "models:/models" in worker["volumes"]
    assert worker["environment"]["SLTUNE_MODELS_DIR"] == "/models"
    worker_cmd = [interpolate(a, ENV) for a in worker["command"]]
    plain = [interpolate(a, ENV) for a in s["worker"]["command"]]
    assert worker_cmd == plain
    sltune_command(worker_cmd)
    assert f"'127.0.0.1', {port}" in " ".join(head["healthcheck"]["test"])
    assert "models" in c["volumes"]


def test_the_ray_profile_s_commands_start_a_cluster_that_runs_a_trial():
    """ray-head's and ray-node's commands run here as they run in their containers (the head's port, and the ports
    Ray would otherwise take at their defaults, free ones on this machine; the head's host this machine), and a trial
    runs on the node."""
    pytest.importorskip("ray", reason="Ray is the optional extra ray: pip install -e '.[ray]'")
    from sltune.executors import executor_for
    from sltune.loopback import free_port
    from sltune.profiling.schema import TrialSpec

    s = load_compose()["services"]
    port = str(free_port())

    def here(argv: list[str]) -> list[str]:
        argv = [port if a == "6379" else f"127.0.0.1:{port}" if a == "ray-head:6379" else a for a in argv]
        ports = ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                 "--runtime-env-agent-port")
        return [str(Path(sys.executable).with_name("ray")), *argv, *(x for p in ports for x in (p, str(free_port())))]

    env = {**os.environ, **s["ray-node"]["environment"]}
    started = []
    try:
        for svc in ("ray-head", "ray-node"):
            started.append(subprocess.Popen(here(s[svc]["command"]), env=env, start_new_session=True,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            if svc == "ray-head":
                check = s["ray-head"]["healthcheck"]["test"][1:]
                code = check[2].replace("6379", port)
                deadline = time.monotonic() + 120
                while subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 0:
                    assert time.monotonic() < deadline and started[0].poll() is None, "the head did not start"
                    time.sleep(1)
        executor = executor_for("ray", f"127.0.0.1:{port}")
        try:
            import ray

            deadline = time.monotonic() + 120
            while not any(n["Alive"] and n["Resources"].get("CPU", 0) > 0 for n in ray.nodes()):
                assert time.monotonic() < deadline and started[1].poll() is None, "the node did not join"
                time.sleep(1)
            result = executor.run(TrialSpec(model="llama-tiny", seq_len=16, steps=1, min_time_s=0.0, max_steps=1,
                                            remeasure=0, profile=False))
            assert result.status == "ok", result.error
        finally:
            executor.close()
    finally:
        for proc in reversed(started):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
