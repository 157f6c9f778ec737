"""Which machine a set of rates belongs to: rates measured on another CPU, GPU, memory size or torch build say
nothing about this one."""

from __future__ import annotations

import hashlib
import os
import platform

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
    """each visible CUDA device's name, in index order"""
    torch: str
    """torch's version and build (+cpu, +cu124, ...)"""

    @property
    def key(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]

    def describe(self) -> str:
        from sltune.sizes import format_bytes

        gpus = f", {', '.join(self.gpus)}" if self.gpus else ""
        return f"{self.cpu}, {self.cores} cores, {format_bytes(self.memory_bytes)}{gpus}, torch {self.torch}"

    @classmethod
    def here(cls) -> "Fingerprint":
        import torch

        gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
            if torch.cuda.is_available() else ()
        return cls(cpu=_cpu_name(), cores=len(os.sched_getaffinity(0)), memory_bytes=psutil.virtual_memory().total,
                   gpus=gpus, torch=torch.__version__)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
