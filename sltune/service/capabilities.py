"""What a worker can run, and whether a job's requirements fit it."""

from __future__ import annotations

import os
from typing import Any


def local_capabilities(ray_address: str | None = None) -> dict[str, Any]:
    """Devices here: the CPU always; CUDA devices with their memory when present (asked of torch where it is
    imported: a worker process has no need of it otherwise, sltune.profiling.forks.call). The executors it runs trials
    with: local, and ray where Ray is installed and a cluster's address is given (`ray_address`, else RAY_ADDRESS)."""
    import importlib.util

    from sltune.profiling import forks

    ray = importlib.util.find_spec("ray") is not None and bool(ray_address or os.environ.get("RAY_ADDRESS"))
    caps: dict[str, Any] = {"devices": {"cpu": {"count": 1, "memory_bytes": None}},
                            "max_world_size": max(1, (os.cpu_count() or 1)), "executors": ["local", *["ray"] * ray]}
    cuda = forks.call(f"{__name__}:cuda_devices")
    if cuda is not None:
        caps["devices"]["cuda"] = cuda
    return caps


def cuda_devices() -> dict[str, int] | None:
    """The CUDA devices torch sees, and the least memory among them; None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    n = torch.cuda.device_count()
    return {"count": n, "memory_bytes": min(torch.cuda.get_device_properties(i).total_memory for i in range(n))}


def can_run(caps: dict[str, Any], req: dict[str, Any]) -> bool:
    return why_not(caps, req) is None


def why_not(caps: dict[str, Any], req: dict[str, Any]) -> str | None:
    if req.get("executor", "local") != "local":     # the cluster's nodes run its trials: their devices and ranks
        if req["executor"] not in caps.get("executors", ["local"]):
            return (f"needs a {req['executor']} cluster (hardware.executor): no worker was started with Ray and "
                    "SLTUNE_RAY_ADDRESS")
        return None
    device = caps["devices"].get(req.get("device", "cpu"))
    if device is None:
        return f"needs device {req.get('device')!r}, offers {', '.join(caps['devices'])}"
    limit, mem = req.get("device_memory_limit"), device.get("memory_bytes")
    if limit and mem and limit > mem:
        return f"needs {limit} bytes of device memory, has {mem}"
    world = req.get("world_size", 1)
    if req.get("device") == "cuda" and world > device["count"]:
        return f"needs {world} GPUs, has {device['count']}"
    if world > caps.get("max_world_size", 1):
        return f"needs world_size {world}, runs at most {caps.get('max_world_size')} ranks"
    return None
