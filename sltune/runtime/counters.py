"""Bytes moved per channel, a plain dataclass without torch: trial results and the service carry it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class IOCounters:
    """Bytes moved per channel. The collective channels count what this rank hands to collectives."""

    param_load_bytes: int = 0       # host -> device parameter copies (or all-gathered shards)
    grad_offload_bytes: int = 0     # device -> host gradient copies (or reduce-scattered)
    act_offload_bytes: int = 0      # device -> host boundary activations and their gradients
    act_load_bytes: int = 0         # host -> device boundary activations and their gradients
    allgather_bytes: int = 0        # parameters handed to all-gather
    reduce_scatter_bytes: int = 0   # gradients handed to reduce-scatter
    kv_load_bytes: int = 0          # host -> device KV cache (generation)
    kv_offload_bytes: int = 0       # device -> host KV cache (generation)
    disk_read_bytes: int = 0        # optimizer_offload disk: masters and optimizer state read from files
    disk_write_bytes: int = 0       # ... and written to new ones

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __add__(self, other: "IOCounters") -> "IOCounters":
        return IOCounters(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: "IOCounters") -> "IOCounters":
        return IOCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def copy(self) -> "IOCounters":
        return IOCounters(**self.as_dict())
