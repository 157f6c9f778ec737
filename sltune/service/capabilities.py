"""What a worker can run, and whether a job's requirements fit it."""

from __future__ import annotations

import os
from typing import Any


def local_capabilities() -> dict[str, Any]:
    """Devices here: the CPU always; CUDA devices with their memory when present."""
    import torch            # here: the API process checks jobs against workers' capabilities without torch

    caps: dict[str, Any] = {"devices": {"cpu": {"count": 1, "memory_bytes": None}},
                            "max_world_size": max(1, (os.cpu_count() or 1))}
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(n))
        caps["devices"]["cuda"] = {"count": n, "memory_bytes": mem}
    return caps


def can_run(caps: dict[str, Any], req: dict[str, Any]) -> bool:
    return why_not(caps, req) is None


def why_not(caps: dict[str, Any], req: dict[str, Any]) -> str | None:
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
