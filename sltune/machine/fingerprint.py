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

# the flags whose instructions decide a kernel's speed (x86's AVX, AMX, FMA and F16C; Arm's SIMD, SVE, bf16, i8mm)
ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "asimd", "sve", "bf16", "i8mm")
SHOWN = ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "sve2", "sve", "asimd")   # describe's, widest first


class Fingerprint(BaseModel):
    """What decides a machine's rates; `key` names it in the job store."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu: str
    """the CPU's model name (/proc/cpuinfo), or the platform's processor where there is none"""
    isa: tuple[str, ...] = ()
    """the CPU's vector and matrix instructions (/proc/cpuinfo's flags: avx2, avx512f, avx512_bf16, amx_bf16, sve,
    ...), sorted: a hypervisor names two CPUs alike ("AMD EPYC") whose bfloat16 matmuls ran at 1-2 and 420-435
    GFLOP/s, one without AVX-512 and one with its bf16 instructions (docs/concepts/machine-rates.md)"""
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
        widest = [flag for flag in SHOWN if flag in self.isa]
        flags = f" ({'/'.join(widest)})" if widest else ""
        return f"{self.cpu}{flags}, {self.cores} cores, {format_bytes(self.memory_bytes)}{gpus}, torch {self.torch}"

    @classmethod
    def here(cls) -> "Fingerprint":
        cpu = first_cpu()           # /proc/cpuinfo read once, for the name and the flags
        return cls(cpu=_cpu_name(cpu), isa=isa(fields=cpu), cores=len(os.sched_getaffinity(0)),
                   memory_bytes=psutil.virtual_memory().total, gpus=_gpus(), torch=version("torch"))


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


def first_cpu(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The fields /proc/cpuinfo gives the first processor ("model name", x86's "flags", Arm's "Features", ...); none
    where the file is missing (macOS, Windows)."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def isa(cpuinfo: str = "/proc/cpuinfo", fields: dict[str, str] | None = None) -> tuple[str, ...]:
    """The instruction flags (ISA_PREFIXES) of the first processor (`fields` as first_cpu reads them from
    `cpuinfo`): none where there are none (macOS, Windows: rates are then told apart by the CPU's name)."""
    fields = first_cpu(cpuinfo) if fields is None else fields
    flags = fields.get("flags", fields.get("Features", "")).split()
    return tuple(sorted({flag for flag in flags if flag.startswith(ISA_PREFIXES)}))


def _cpu_name(fields: dict[str, str]) -> str:
    return fields.get("model name") or platform.processor() or platform.machine()
