"""Which machine a set of rates belongs to: rates measured on another CPU, GPU, memory size or torch build say
nothing about this one. Taken without importing torch, so that `plan` finds the rates stored for this machine in a
process that never loads it (calibrate takes the same fingerprint the same way)."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from importlib.metadata import version

import psutil
from pydantic import BaseModel, ConfigDict


class Fingerprint(BaseModel):
    """What decides a machine's rates; `key` names it in the job store."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu: str
    """the CPU's model name (/proc/cpuinfo), or the platform's processor where there is none"""
    cores: int
    """the cores this process may run on (its affinity), not the machine's count"""
    memory_bytes: int
    """the machine's memory"""
    gpus: tuple[str, ...] = ()
    """each visible NVIDIA GPU's name (nvidia-smi's, as torch.cuda names them), in index order"""
    torch: str
    """torch's version and build (+cpu, +cu124, ...), as installed"""

    @property
    def key(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    def describe(self) -> str:
        from sltune.sizes import format_bytes

        gpus = f", {', '.join(self.gpus)}" if self.gpus else ""
        return f"{self.cpu}, {self.cores} cores, {format_bytes(self.memory_bytes)}{gpus}, torch {self.torch}"

    @classmethod
    def here(cls) -> "Fingerprint":
        return cls(cpu=_cpu_name(), cores=len(os.sched_getaffinity(0)), memory_bytes=psutil.virtual_memory().total,
                   gpus=_gpus(), torch=version("torch"))


def _gpus() -> tuple[str, ...]:
    """The NVIDIA GPUs this process sees (CUDA_VISIBLE_DEVICES' indices, where it names them by index); none where
    nvidia-smi is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    names = [line.strip() for line in out.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        picked = [int(i) for i in visible.split(",") if i.strip().isdigit()]
        names = [names[i] for i in picked if i < len(names)]
    return tuple(names)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
