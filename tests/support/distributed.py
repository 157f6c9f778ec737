"""torchrun with two ranks on a free port, from the repository root: the scripts beside this module
import tests.support from there."""

import subprocess
import sys
from pathlib import Path

from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


def torchrun(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(free_port()), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)
