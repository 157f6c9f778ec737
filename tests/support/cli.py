"""The `sltune` command as tests run it: in this process by default, as a subprocess when the process is the point.

In this process, a call skips the ~4 CPU-seconds a fresh interpreter spends importing torch and transformers,
which, over the suite's CLI calls, is minutes on a busy 2-core machine. A test takes the subprocess
(`process=True`) when it checks what only a process shows: an exit on a signal, warnings printed at import, a
kill, torchrun, or a command that starts servers or fork servers (tune, serve, worker).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path


def sltune(*args: str, env: dict[str, str] | None = None, cwd: str | Path | None = None, timeout: float = 300,
           process: bool = False) -> subprocess.CompletedProcess:
    """`sltune ARGS` with its exit code, stdout and stderr, as subprocess.run(capture_output=True, text=True)
    returns them; `env` is added to this process's environment."""
    if process:
        return subprocess.run([sys.executable, "-m", "sltune", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})
    return _here(list(args), env or {}, cwd)


def _here(args: list[str], env: dict[str, str], cwd: str | Path | None) -> subprocess.CompletedProcess:
    from sltune.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.update(env)
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as exit_:         # argparse's usage errors and --help
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["sltune", *args], code, out.getvalue(), err.getvalue())
