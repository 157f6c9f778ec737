"""DeepSpeed's compiled ops, ready before a trial starts: a trial never compiles.

DeepSpeed compiles an op it was installed without the first time a process loads it (torch.utils.cpp_extension
with ninja), inside `deepspeed.initialize`: CPU Adam where the optimizer is offloaded, the shared-memory all-reduce
on its CPU accelerator (every initialize loads it), async I/O for nvme. In a trial that is minutes of the trial's
setup and its timeout (a new user's first DeepSpeed trial timed out at 300 s, the next took 100-205 s each).
`scripts/install.sh` builds them at install time (DS_BUILD_CPU_ADAM, DS_BUILD_SHM_COMM), which this module reads
without importing torch or DeepSpeed (the file the install wrote). Where they are missing, `prepare` builds them
once, in a process of its own outside any trial, into torch's extension cache, where each trial's load then finds
them; it says so in a line first, and a build that fails or runs past its time is one line naming the install.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

INSTALL = "bash scripts/install.sh backends"
# op name (DeepSpeed's) -> its builder's class on the accelerator, and what loads it
BUILDERS = {"cpu_adam": ("CPUAdamBuilder", "the optimizer offloaded (DeepSpeedCPUAdam)"),
            "deepspeed_shm_comm": ("ShareMemCommBuilder", "the CPU accelerator's all-reduce (every initialize)"),
            "async_io": ("AsyncIOBuilder", "nvme offload")}
BUILD_TIMEOUT_S = 1800.0
_READY: set[tuple[str, str]] = set()        # (accelerator, op) built or found in this process
_FAILED: dict[tuple[str, str], str] = {}    # (accelerator, op) whose build failed here: why (not tried again)


def accelerator_of(device: str) -> str:
    """DeepSpeed's accelerator for a trial's device (its CPU accelerator without a GPU)."""
    return "cuda" if device.startswith("cuda") else "cpu"


def needed(accelerator: str, offload_optimizer: str = "none", offload_param: str = "none",
           optimizer: str = "adamw") -> list[str]:
    """The ops a DeepSpeed trial of these knobs loads."""
    ops = ["deepspeed_shm_comm"] if accelerator == "cpu" else []
    if offload_optimizer != "none" and optimizer == "adamw":
        ops.append("cpu_adam")
    if "nvme" in (offload_optimizer, offload_param):
        ops.append("async_io")
    return ops


def prebuilt(accelerator: str) -> dict[str, bool]:
    """The ops DeepSpeed's install compiled for this accelerator, from the file its setup wrote (no import of torch
    or DeepSpeed); none when DeepSpeed is missing or was built for another accelerator."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return {}
    found = _constants(Path(list(spec.submodule_search_locations)[0]) / "git_version_info_installed.py")
    ops = found.get("installed_ops")
    if found.get("accelerator_name") != accelerator or not isinstance(ops, dict):
        return {}
    return {name: bool(built) for name, built in ops.items()}


def missing(ops: Iterable[str], accelerator: str) -> list[str]:
    """Those of `ops` neither prebuilt, nor built into torch's extension cache, nor made ready by this process."""
    built = prebuilt(accelerator)
    return [op for op in dict.fromkeys(ops)
            if not built.get(op) and (accelerator, op) not in _READY and not (jit_cache() / op / f"{op}.so").is_file()]


def jit_cache() -> Path:
    """Where torch.utils.cpp_extension builds an op DeepSpeed compiles on first load (its _get_build_directory), read
    without importing torch: TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py311_cpu (or _cu128, ...). An op
    found there loads in a second; one whose sources changed since (another DeepSpeed) would build again in its
    trial."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    versions: dict[str, object] = {}
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        versions = _constants(Path(list(spec.submodule_search_locations)[0]) / "version.py")
    hip, cuda = versions.get("hip"), versions.get("cuda")
    device = (f"rocm{str(hip).replace('.', '')}" if hip else f"cu{str(cuda).replace('.', '')}" if cuda else "cpu")
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return root / f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{device}"


def _constants(path: Path) -> dict[str, object]:
    """The literal assignments of a generated Python file (DeepSpeed's install record, torch's version.py)."""
    found: dict[str, object] = {}
    try:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                try:
                    found[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    except (OSError, SyntaxError):
        return {}
    return found


def prepare(ops: Iterable[str], accelerator: str, say: Callable[[str], None] | None = None,
            timeout_s: float = BUILD_TIMEOUT_S) -> str | None:
    """Make the ops a DeepSpeed trial loads ready before it starts: nothing when they are prebuilt (or this process
    made them ready already), else one build in a process of its own, its progress through `say`. None when they
    are ready, else why not, in one line naming the install."""
    todo = missing(ops, accelerator)
    if not todo:
        return None
    failed = next((_FAILED[(accelerator, op)] for op in todo if (accelerator, op) in _FAILED), None)
    if failed:
        return failed
    if importlib.util.find_spec("deepspeed") is None:
        return f"DeepSpeed is not installed here; install it with `{INSTALL}`"
    if timeout_s <= 0:
        return f"no time left to build DeepSpeed's {', '.join(todo)} op before its trial; install them with `{INSTALL}`"
    if say:
        say(f"building DeepSpeed's {', '.join(todo)} op{'s' if len(todo) > 1 else ''} once, before its first trial "
            f"(minutes on a small machine; `{INSTALL}` builds them at install time)")
    began = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", __name__, "--build", accelerator, *todo], capture_output=True,
                              text=True, timeout=timeout_s, env={**os.environ, "DS_ACCELERATOR": accelerator})
    except subprocess.TimeoutExpired:
        return _failed(todo, accelerator, f"building DeepSpeed's {', '.join(todo)} op took over {timeout_s:.0f}s and "
                                          f"was stopped; install them with `{INSTALL}`")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
        return _failed(todo, accelerator, f"DeepSpeed's {', '.join(todo)} op could not be built here ({last[:300]}); "
                                          f"install them with `{INSTALL}`")
    _READY.update((accelerator, op) for op in todo)
    if say:
        say(f"DeepSpeed's ops ready in {time.monotonic() - began:.0f}s: " + "; ".join(done.stdout.strip().splitlines()))
    return None


def _failed(ops: list[str], accelerator: str, why: str) -> str:
    """why, remembered for these ops: the trials after it are answered with it, not built again."""
    _FAILED.update(((accelerator, op), why) for op in ops)
    return why


def _build(accelerator: str, ops: list[str]) -> int:
    """In a process of its own: load each op, which compiles it into torch's extension cache unless it is there."""
    os.environ["DS_ACCELERATOR"] = accelerator
    from deepspeed.accelerator import get_accelerator

    for op in ops:
        builder = get_accelerator().create_op_builder(BUILDERS[op][0])
        if builder is None or not builder.is_compatible(verbose=False):
            print(f"{op}: not compatible with this machine (DeepSpeed does without it)")
            continue
        began = time.monotonic()
        builder.load(verbose=False)
        print(f"{op} ({BUILDERS[op][1]}) in {time.monotonic() - began:.0f}s")
    return 0


def remember_cpu_info() -> None:
    """py-cpuinfo's answer kept per CPU beside the ops, for DeepSpeedCPUAdam asks it each time one is built (for the
    CPU's vendor): py-cpuinfo starts a Python of its own that times the clock over a second, busy-waiting on it,
    1.3 s here, all of it CPU, in every rank of every trial that offloads the optimizer. Asked once a CPU, it is
    read from the file after; an empty answer (py-cpuinfo failed) is not kept."""
    try:
        import cpuinfo
    except ImportError:
        return
    asked = cpuinfo.get_cpu_info
    if getattr(asked, "remembered", False):
        return

    def get_cpu_info() -> dict:
        path = cpu_info_file()
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        info = asked()
        if info:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                part = path.with_name(f"{path.name}.{os.getpid()}")
                part.write_text(json.dumps(info))
                os.replace(part, path)
            except OSError:
                pass            # a cache it cannot write: asked again next time
        return info

    get_cpu_info.remembered = True          # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def cpu_info_file() -> Path:
    """Where remember_cpu_info keeps py-cpuinfo's answer: in the ops' cache, named by a digest of what
    /proc/cpuinfo says of the first CPU (its clock aside), so that a home shared by two kinds of CPU keeps two."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        first = platform.processor() or platform.machine()
    said = "\n".join(line for line in first.splitlines() if not line.startswith("cpu MHz"))
    return jit_cache() / f"py-cpuinfo-{hashlib.sha256(said.encode()).hexdigest()[:16]}.json"


def main(argv: list[str]) -> int:
    """`python -m sltune.backends.deepspeed_ops --check ACCELERATOR`: exit 0 when DeepSpeed is installed with the ops
    its trials load prebuilt (scripts/install.sh asks); `--build ACCELERATOR OP...`: compile those now."""
    if len(argv) >= 2 and argv[0] == "--check":
        ops = needed(argv[1], offload_optimizer="cpu")
        return 0 if importlib.util.find_spec("deepspeed") and not missing(ops, argv[1]) else 1
    if len(argv) >= 3 and argv[0] == "--build" and all(op in BUILDERS for op in argv[2:]):
        return _build(argv[1], argv[2:])
    print(f"usage: python -m {__name__} --check ACCELERATOR | --build ACCELERATOR OP... (OP: {', '.join(BUILDERS)})",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
