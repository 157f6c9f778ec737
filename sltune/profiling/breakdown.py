"""Where a step's time went, from the PyTorch profiler's events (not from a formula).

The runtime labels its phases (sltune.runtime.regions). Nesting the profiler's events by time on the
step's thread and walking down from the step's event:
  compute         ATen operators inside compute regions (the model's forward, recompute, backward, head)
  memcpy          the runtime's copy regions, whole
  all_gather,
  reduce_scatter  the collective regions, whole
  cpu             host-side regions (the optimizer stepping host parameters), plus the time inside
                  compute regions not spent in an operator (Python, module calls, autograd bookkeeping)
  disk            optimizer_offload disk: the step waiting, after the backward, for the optimizer's files to be
                  written and committed (reads and writes under compute and stepping are not waited for)
  other           the step's time outside every region (the runtime's own bookkeeping between phases)
A wrapped backend (DeepSpeed, FSDP2: sltune.backends) labels the phases it drives the same way; the
collectives its wrapper issues inside them are found by the profiler's names for them (c10d's and gloo's
ops, FSDP2's all-gather and reduce-scatter labels): all-gathers and reduce-scatters have their slices, other
collectives (all-reduce, broadcast) are other.
Fractions are of the step's wall time and sum to 1. On CUDA the device timeline decides: kernels within
the steps are classified by name (host<->device memcpy; NCCL all-gather, reduce-scatter, and its other
collectives as other; every other kernel, device-to-device copies and memsets included, as compute); the
runtime's own labels, which Kineto also reports on the device, are left out; step time no kernel covers
is cpu. Top operators come from every host thread (CUDA runs backward on autograd's device thread).

The events are read from the profiler's raw (Kineto) results: building torch's FunctionEvent tree
costs seconds for the ~35k events of a small step; nesting them here costs a tenth of that.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch.profiler import ProfilerActivity, profile

from sltune.runtime.regions import STEP, category_of
from sltune.runtime.spans import union_length

SLICES = ("compute", "memcpy", "cpu", "all_gather", "reduce_scatter", "disk", "other")


@dataclass
class Breakdown:
    seconds: dict[str, float]                   # raw seconds per slice
    wall_seconds: float                         # the profiled step's wall time
    top_ops: list[dict[str, Any]] = field(default_factory=list)
    copy_hidden: float | None = None            # CUDA: share of host<->device copy time under compute kernels

    @property
    def fractions(self) -> dict[str, float]:
        total = sum(self.seconds.values())
        return {k: (v / total if total > 0 else 0.0) for k, v in self.seconds.items()}


class Event(NamedTuple):
    start: int      # ns
    end: int
    name: str
    thread: int
    on_device: bool


def profile_call(fn: Callable[[], Any], trace_path: str | None = None, top: int = 10) -> Breakdown:
    """Run fn once under the profiler; attribute its steps' time; optionally write a Chrome trace."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with _kineto_quiet(), profile(activities=activities) as prof:
        fn()
    if trace_path:
        _export(prof, str(trace_path))
    return attribute(_events(prof), top)


def _export(prof, path: str) -> None:
    """Write the trace, or nothing: a full disk costs the call its trace (the caller finds no file), not its
    figures. Kineto reports no write error (a full disk leaves an empty file, and its cut-off PATH.tmp), so the
    file is read back, and neither is left behind."""
    try:
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            json.load(f)
    except (OSError, ValueError, RuntimeError):
        for leftover in (path, path + ".tmp"):
            with contextlib.suppress(OSError):
                os.unlink(leftover)


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """Kineto prints 'profiler_start'/'profiler_stop' lines to fd 2 from C++ with no setting to stop it;
    they would land in every CLI's output. Errors still surface as exceptions."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _events(prof) -> list[Event]:
    cpu = torch.autograd.DeviceType.CPU
    return [Event(k.start_ns(), k.start_ns() + k.duration_ns(), k.name(), k.start_thread_id(),
                   k.device_type() != cpu)
            for k in prof.profiler.kineto_results.events()]


def attribute(events: list[Event], top: int = 10) -> Breakdown:
    steps = [i for i, e in enumerate(events) if e.name == STEP and not e.on_device]
    if not steps:
        raise RuntimeError("the profiled call ran no sltune step")
    thread = events[steps[0]].thread
    host = sorted((e for e in events if not e.on_device and e.thread == thread),
                  key=lambda e: (e.start, -e.end))
    children = _nest(host)
    seconds: dict[str, float] = defaultdict(float)
    windows = []
    for i, e in enumerate(host):
        if e.name == STEP:
            windows.append((e.start, e.end))
            _attribute(host, children, i, None, seconds)
    wall = sum(b - a for a, b in windows)
    device = [e for e in events if e.on_device and not e.name.startswith("sltune.")]  # not the annotations
    hidden = _attribute_device(device, windows, seconds) if device else None
    seconds = {k: max(0.0, seconds.get(k, 0.0)) / 1e9 for k in SLICES}
    return Breakdown(seconds=seconds, wall_seconds=wall / 1e9, top_ops=_top_ops(events, windows, top),
                     copy_hidden=hidden)


def _top_ops(events: list[Event], windows: list[tuple[int, int]], top: int) -> list[dict[str, Any]]:
    """Operators by self time on every host thread during the steps: CUDA runs backward on autograd's
    device thread, not on the step's."""
    self_ns: dict[str, list[float]] = defaultdict(lambda: [0, 0])
    by_thread: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        if not e.on_device and any(a <= e.start and e.end <= b for a, b in windows):
            by_thread[e.thread].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.start, -e.end))
        _self_times(evs, _nest(evs), self_ns)
    ops = sorted(((n, c, t) for n, (c, t) in self_ns.items() if not n.startswith("sltune.")),
                 key=lambda x: x[2], reverse=True)[:top]
    return [{"name": n, "count": c, "self_seconds": t / 1e9} for n, c, t in ops]


def collective_of(name: str) -> str | None:
    """The slice of a collective the profiler names (a wrapper's, outside the runtime's regions), or None."""
    n = name.lower()
    if not n.startswith(("c10d::", "gloo:", "nccl:", "fsdp::")):
        return None
    if "all_gather" in n or "allgather" in n:
        return "all_gather"
    if "reduce_scatter" in n or "reducescatter" in n or "post_backward_reduce" in n:
        return "reduce_scatter"
    if n.startswith("fsdp::"):      # FSDP2's hooks around its collectives: looked into, not a collective
        return None
    return "other"


def _nest(events: list[Event]) -> list[list[int]]:
    """children[i]: the events directly inside event i (events sorted by start, longest first)."""
    children: list[list[int]] = [[] for _ in events]
    stack: list[int] = []
    for i, e in enumerate(events):
        while stack and events[stack[-1]].end < e.end:
            stack.pop()
        if stack:
            children[stack[-1]].append(i)
        stack.append(i)
    return children


def _attribute(events, children, i: int, category: str | None, seconds: dict[str, float]) -> None:
    """Add event i's time under `category` (None: the step's own time), minus nested regions."""
    covered = 0
    for c in children[i]:
        child = events[c]
        span = child.end - child.start
        cat = category_of(child.name) or collective_of(child.name)
        if cat is not None:
            _attribute(events, children, c, cat, seconds)
            covered += span
        elif category == "compute" and child.name.startswith("aten::"):
            seconds["compute"] += span
            covered += span
        elif category in (None, "compute", "cpu"):
            # autograd wrappers, optimizer hooks and the like: look inside them for ops, regions and collectives
            _attribute(events, children, c, category, seconds)
            covered += span
    own = (events[i].end - events[i].start) - covered
    if category is None:
        seconds["other"] += own
    elif category == "compute":
        seconds["cpu"] += own       # time in a compute region spent outside operators
    else:
        seconds[category] += own


def _self_times(events, children, out: dict[str, list[float]]) -> None:
    for i, e in enumerate(events):
        inner = sum(events[c].end - events[c].start for c in children[i])
        entry = out[e.name]
        entry[0] += 1
        entry[1] += (e.end - e.start) - inner


def kernel_slice(name: str) -> str:
    """The slice of one device kernel by its name. Host<->device copies are memcpy; copies and memsets within
    the device are the device's own work (compute); NCCL all-gather and reduce-scatter have their slices,
    its other collectives (the loss all-reduce, the initial broadcast) are other."""
    n = name.lower()
    if "nccl" in n:
        if "allgather" in n or "all_gather" in n:
            return "all_gather"
        if "reducescatter" in n or "reduce_scatter" in n:
            return "reduce_scatter"
        return "other"
    if n.startswith("memcpy") and ("htod" in n or "dtoh" in n):
        return "memcpy"
    return "compute"


def _attribute_device(kernels: list[Event], windows: list[tuple[int, int]],
                      seconds: dict[str, float]) -> float | None:
    """On CUDA the device timeline is the truth. Each slice is the union of its kernels' intervals within the
    steps (streams overlap, so their sum could exceed the wall); step time no kernel covers is cpu. Overlaps
    between slices are left in, and fractions are normalised by their total. Returns the share of copy time
    that compute kernels hide (None without copies): the overlap SpeedLoader's prefetch is for."""
    wall = sum(b - a for a, b in windows)
    by_slice: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for e in kernels:
        for a, b in windows:
            lo, hi = max(e.start, a), min(e.end, b)
            if lo < hi:
                by_slice[kernel_slice(e.name)].append((lo, hi))
    for k in SLICES:
        seconds[k] = union_length(by_slice.get(k, []))
    busy = union_length([iv for ivs in by_slice.values() for iv in ivs])
    seconds["cpu"] = max(0.0, wall - busy)
    copies, compute = by_slice.get("memcpy", []), by_slice.get("compute", [])
    if not copies:
        return None
    # |copies and compute| = |copies| + |compute| - |copies or compute|
    return (seconds["memcpy"] + seconds["compute"] - union_length(copies + compute)) / seconds["memcpy"]
