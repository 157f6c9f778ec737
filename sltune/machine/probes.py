"""The probes, and `calibrate`: each probe times one kind of work a step is made of, at the shapes it has in the
model to be tuned, within its share of a time budget (60 s by default: a qwen2-0.5b shape in bfloat16 takes about 40
s on 2 cores)."""

from __future__ import annotations

import itertools
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from sltune.machine.collectives import collectives
from sltune.machine.fingerprint import Fingerprint
from sltune.machine.rates import AttentionRate, DecodeAttentionRate, MachineRates, MatmulRate, Rate
from sltune.machine.timing import first_call_s, per_call_s
from sltune.machine.workload import Workload
from sltune.runtime.disk.direct_io import DirectFiles, aligned_empty
from sltune.training.optimizer import OptimizerConfig

Sync = Callable[[], None]       # waits for the device's queued work (nothing on the CPU)
COPY_BYTES = 64 << 20       # a copy or a file this large: past the caches, like a layer's weights
# Elementwise and norm work reads its inputs from this much memory, a new stretch each call, into a new output: a
# step's activations are read from memory, not from the cache one tensor used again and again is read from (an add
# over 128-512 rows of llama-small's widths ran 2-3x faster hot, 12-15 against 4-7 billion elements/s, 2-core EPYC)
RING_BYTES = 256 << 20
OPTIMIZER_ELEMENTS = 1 << 22


def calibrate(workload: Workload = Workload(), device: str = "cpu", budget_s: float = 60.0,
              offload_dir: str | Path | None = None, progress: Callable[[str], None] = lambda _: None,
              optimizers: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] | None = None,
              world_sizes: tuple[int, ...] = (), processes: Any = None) -> MachineRates:
    """This machine's rates for `workload` on `device`, in about `budget_s` seconds (each probe's warm-up and 3
    samples at least: a tiny budget still measures everything once).

    `offload_dir`: where the disk is timed (a temporary folder in it; default the system's temporary folder).
    `progress` is told each probe's name as it starts. `optimizers`: the optimizers to time, by name (default: the
    runtime's host AdamW, fused, as sltune.training.optimizer builds it). `world_sizes`: the collectives' rank
    counts, the ranks started from `processes` (a multiprocessing context)."""
    start = time.perf_counter()
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    dtype = getattr(torch, workload.dtype)
    # each weight's forward (rows x k @ k x n; its input's gradient does the same work transposed) and its weight's
    # gradient (n x rows @ rows x k), whose reduction runs over the rows: far slower per FLOP at a few rows;
    # generation has no backward, and runs its decode steps at a sub-batch's rows
    shapes = sorted({(rows, k, n) for k, n in workload.matmuls for rows in (*workload.rows, *workload.decode_rows)}
                    | ({(n, rows, k) for k, n in workload.matmuls for rows in workload.rows}
                       if not workload.generation else set()))
    # the probes still to run: each gets its share of the budget that is left
    left = [len(shapes) + len(workload.rows) + len(workload.decode_rows) + 5 + len(optimizers or [None])
            + len(world_sizes)]

    def share() -> float:
        left[0] -= 1
        return max(0.0, budget_s - (time.perf_counter() - start)) / (left[0] + 1)

    progress("matmuls")
    matmul: list[MatmulRate] = []
    for rows, k, n in shapes:
        cold = rows in workload.decode_rows and rows not in workload.rows
        if (m := _matmul(rows, k, n, dtype, dev, sync, share(), {(m.rows, m.k, m.n) for m in matmul},
                         cold)) is not None:
            matmul.append(m)
    progress("attention")
    attention: list[AttentionRate] = []
    for rows in workload.rows:
        a = _attention(max(1, rows // workload.seq_len), workload, dtype, dev, sync, share(),
                       {a.batch for a in attention})
        attention += [a] if a is not None else []
    if workload.generation:
        progress("decode attention")
    decode = [_decode_attention(b, workload, dtype, dev, sync, share()) for b in workload.decode_rows]
    progress("elementwise and norm")
    rows = max(workload.rows)
    elementwise = {workload.dtype: _elementwise(rows, workload.hidden, dtype, dev, sync, share())}
    norm = {workload.dtype: _norm(rows, workload.hidden, dtype, dev, sync, share())}
    progress("optimizer")
    numels = workload.param_numels or (OPTIMIZER_ELEMENTS,)
    makers = optimizers or {"torch.adamw": OptimizerConfig().build}
    optimizer = {name: _optimizer(make, numels, share()) for name, make in makers.items()}
    progress("copies")
    copies = _copies(dev, sync, share())
    progress("disk")
    disk, direct = _disk(Path(offload_dir or tempfile.gettempdir()), share())
    progress("op overhead")
    overhead = _op_overhead(dev, sync, share())
    collective: dict[str, Rate] = {}
    for world in world_sizes:
        progress(f"collectives on {world} ranks")
        collective.update(collectives(world, device, share(), processes))
    return MachineRates(fingerprint=Fingerprint.here(), measured_at=datetime.now(timezone.utc),
                        seconds=time.perf_counter() - start, device=str(dev), threads=torch.get_num_threads(),
                        matmul=matmul, attention=attention, decode_attention=decode, elementwise=elementwise,
                        norm=norm, optimizer=optimizer, copies=copies, disk=disk, disk_direct=direct,
                        op_overhead=overhead, collectives=collective,
                        collective_backend=("nccl" if dev.type == "cuda" else "gloo") if world_sizes else None)


def _rate(fn: Callable[[], object], work: float, unit: str, sync: Sync, budget_s: float,
          warm_s: float | None = None) -> Rate:
    warm_s = first_call_s(fn, sync) if warm_s is None else warm_s
    return Rate.of([work / s for s in per_call_s(fn, budget_s, sync, warm_s)], unit)


def _largest_within(size: int, start: int, call_for: Callable[[int], Callable[[], object]], sync: Sync,
                    budget_s: float) -> tuple[int, Callable[[], object], float]:
    """The largest of start, 2 x start, ... up to `size` whose one call takes at most a fifth of `budget_s` (`start`
    at least): that size, its call and the call's time. A vocabulary-wide head in a dtype the CPU has no
    instructions for cannot be timed whole at every row count within a minute."""
    n = min(size, start)
    while True:
        fn = call_for(n)
        warm_s = first_call_s(fn, sync)
        if n >= size or 2 * warm_s > budget_s / 5:
            return n, fn, warm_s
        n = min(size, 2 * n)


def _matmul(rows: int, k: int, n: int, dtype: torch.dtype, dev: torch.device, sync: Sync, budget_s: float,
            done: set[tuple[int, int, int]], cold: bool = False) -> MatmulRate | None:
    """rows x k @ k x n, on fewer rows where the whole would not fit the budget (the entry says how many); None when
    that cut lands on a size already measured. `cold`: each call reads its weight from memory (a decode step's few
    rows read a layer's weights once, just loaded, where a cached one ran 2-3x faster), else the same weight."""
    weights = itertools.cycle(cold_inputs(1, k, n, dtype, dev) if cold else [[torch.randn(k, n, dtype=dtype,
                                                                                           device=dev)]])

    def call_for(r: int) -> Callable[[], object]:
        a = torch.randn(r, k, dtype=dtype, device=dev)
        return lambda: a @ next(weights)[0]

    measured, fn, warm_s = _largest_within(rows, 8, call_for, sync, budget_s)
    if (measured, k, n) in done:
        return None
    flops = _rate(fn, 2.0 * measured * k * n, "FLOP", sync, budget_s, warm_s)
    return MatmulRate(rows=measured, k=k, n=n, dtype=str(dtype).removeprefix("torch."), flops=flops)


def _attention(batch: int, w: Workload, dtype: torch.dtype, dev: torch.device, sync: Sync, budget_s: float,
               done: set[int]) -> AttentionRate | None:
    """Causal attention over `batch` rows, on fewer where the whole would not fit the budget (the entry says how
    many); None when that cut lands on a batch already measured."""
    def call_for(b: int) -> Callable[[], object]:
        q, k, v = (torch.randn(b, w.heads, w.seq_len, w.head_dim, dtype=dtype, device=dev) for _ in range(3))
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    measured, fn, warm_s = _largest_within(batch, 1, call_for, sync, budget_s)
    if measured in done:
        return None
    flops = _rate(fn, 4.0 * measured * w.heads * w.seq_len ** 2 * w.head_dim, "FLOP", sync, budget_s, warm_s)
    return AttentionRate(batch=measured, heads=w.heads, seq=w.seq_len, head_dim=w.head_dim,
                         dtype=str(dtype).removeprefix("torch."), flops=flops)


def _decode_attention(batch: int, w: Workload, dtype: torch.dtype, dev: torch.device, sync: Sync,
                      budget_s: float) -> DecodeAttentionRate:
    """One query position per row over w.kv_len positions of past: a decode step's attention at its longest."""
    q = torch.randn(batch, w.heads, 1, w.head_dim, dtype=dtype, device=dev)
    k, v = (torch.randn(batch, w.heads, w.kv_len, w.head_dim, dtype=dtype, device=dev) for _ in range(2))
    flops = _rate(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                  4.0 * batch * w.heads * w.kv_len * w.head_dim, "FLOP", sync, budget_s)
    return DecodeAttentionRate(batch=batch, heads=w.heads, past=w.kv_len, head_dim=w.head_dim,
                               dtype=str(dtype).removeprefix("torch."), flops=flops)


def _elementwise(rows: int, hidden: int, dtype: torch.dtype, dev: torch.device, sync: Sync, budget_s: float) -> Rate:
    pairs = itertools.cycle(cold_inputs(2, rows, hidden, dtype, dev))
    return _rate(lambda: torch.add(*next(pairs)), float(rows * hidden), "elements", sync, budget_s)


def _norm(rows: int, hidden: int, dtype: torch.dtype, dev: torch.device, sync: Sync, budget_s: float) -> Rate:
    inputs = itertools.cycle(cold_inputs(1, rows, hidden, dtype, dev))
    weight = torch.ones(hidden, dtype=dtype, device=dev)
    return _rate(lambda: torch.nn.functional.rms_norm(next(inputs)[0], (hidden,), weight, 1e-6), float(rows * hidden),
                 "elements", sync, budget_s)


def cold_inputs(count: int, rows: int, hidden: int, dtype: torch.dtype, dev: torch.device) -> list[list[torch.Tensor]]:
    """Sets of `count` rows x hidden tensors filling RING_BYTES between them (at least two sets): each call takes
    the next set, which no call has read since the ring last came round."""
    size = rows * hidden
    sets = max(2, RING_BYTES // dtype.itemsize // (count * size))
    tile = torch.empty(min(size, 1 << 20), dtype=dtype, device=dev).uniform_(-1, 1)
    ring = tile.repeat(-(-sets * count * size // tile.numel()))        # repeated: a tenth of filling it at random
    return [[ring[(i * count + j) * size:(i * count + j + 1) * size].view(rows, hidden) for j in range(count)]
            for i in range(sets)]


def _optimizer(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], numels: tuple[int, ...],
               budget_s: float) -> Rate:
    """An optimizer's step on float32 host tensors of a layer's sizes, as the runtime steps them on the host (the
    parameters are stepped as one list, where the runtime steps a unit's at a time: a layer is a unit)."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in numels]
    for p in params:
        p.grad = torch.randn_like(p)
    return _rate(make(params).step, float(sum(numels)), "elements", lambda: None, budget_s)


def _copies(dev: torch.device, sync: Sync, budget_s: float) -> dict[str, Rate]:
    """Host<->device bytes per second, each direction from pinned and pageable host memory; on the CPU one memcpy
    between host tensors (the CPU device's and the emulated device's copy)."""
    host = torch.empty(COPY_BYTES, dtype=torch.uint8)
    if dev.type != "cuda":
        # "host.fresh": into a new buffer each time, as a wrapper's flat gradient buffers and casts are made each
        # step (past the allocator's cache, each page faulted in: 4 GiB/s here against 12-14 reused)
        other = torch.empty_like(host)
        return {"host": _rate(lambda: other.copy_(host), float(COPY_BYTES), "bytes", sync, budget_s / 4),
                "host.fresh": _rate(lambda: torch.empty_like(host).copy_(host), float(COPY_BYTES), "bytes", sync,
                                    budget_s / 4)}
    on_device = torch.empty(COPY_BYTES, dtype=torch.uint8, device=dev)
    pinned = host.pin_memory()
    out = {}
    for kind, buf in (("pinned", pinned), ("pageable", host)):
        out[f"h2d.{kind}"] = _rate(lambda: on_device.copy_(buf, non_blocking=True), float(COPY_BYTES), "bytes", sync,
                                   budget_s / 4)
        out[f"d2h.{kind}"] = _rate(lambda: buf.copy_(on_device, non_blocking=True), float(COPY_BYTES), "bytes", sync,
                                   budget_s / 4)
    return out


def _disk(folder: Path, budget_s: float) -> tuple[dict[str, Rate], bool]:
    """Flushed writes and reads of one file through the engine's DirectFiles (O_DIRECT where the folder's
    filesystem allows it, as the disk tier runs), in a temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="sltune-calibrate-", dir=folder) as tmp:
        files = DirectFiles(Path(tmp))
        buf = aligned_empty(COPY_BYTES).random_(0, 255)
        path = Path(tmp) / "probe.bin"
        write = _rate(lambda: files.write(path, buf, COPY_BYTES, "calibrate"), float(COPY_BYTES), "bytes",
                      lambda: None, budget_s / 2)
        read = _rate(lambda: files.read(path, buf, COPY_BYTES), float(COPY_BYTES), "bytes", lambda: None,
                     budget_s / 2)
        return {"write": write, "read": read}, files.direct


def _op_overhead(dev: torch.device, sync: Sync, budget_s: float) -> Rate:
    """Ops per second of an add on one element: what each op costs besides its work (dispatch, a kernel launch)."""
    x = torch.zeros(1, device=dev)
    return _rate(lambda: x.add_(1), 1.0, "ops", sync, budget_s)
