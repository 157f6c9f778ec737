"""The traffic one train_step should move, channel by channel, computed by walking the same phase plan a step runs
(sltune.runtime.phases). The tests hold the engine's counters to it, so a change to the schedule that moves other
bytes than these fails there.

Bytes per step, per channel (P_u: parameter bytes of unit u, G_u: its trainable gradient bytes, e = b*s*hidden*
itemsize: one boundary activation of one sub-batch, S: the bytes autograd saves in one sub-batch's forward of
every group below the last and of the embedding, each tensor once, parameters excluded):

    speedloader  param_load = sum_u 2*P_u - P_last - P_head - P_tied   (the turnaround and tied weights load once)
                 grad_offload = sum_u G_u
        recompute  act_offload = N*(2G)*e: G group inputs forward, G input gradients backward
                   act_load = N*(3G-1)*e: G inputs forward; each group below the last its input and its
                              output's gradient; the embedding its output's gradient
        offload    act_offload = N*(2G)*e + N*S
                   act_load = N*(2G)*e + N*S: no group loads its input again, every saved tensor comes back once
    canonical    N times speedloader's param_load and grad_offload at N=1; no activation traffic
    resident     nothing

Under mixed precision (a float32 master on the host) P_u stays in dtype bytes: the device loads the dtype copy,
refreshed from the master after each step. G_u is in float32 bytes (the device sums the sub-batches' gradients in
float32 and offloads the sum once), except canonical's, which offloads each micro-batch's dtype gradients.

optimizer_offload disk (sltune.runtime.disk.state) moves the float32 masters and the optimizer state through files,
each block once each way per step (n_b values, m = 4 bytes of master or 0 without one, s the optimizer state's bytes
per value; the first step reads only the masters):

    disk_read = disk_write = sum_b pad4096(n_b * (m + s))

param_offload disk (sltune.runtime.disk.weightfiles) adds the dtype copies' files: every load reads its unit's file,
every stepped unit's new copy is written once (and its file read once more first when the step needs its values: no
master, or frozen values the copy keeps):

    disk_read += sum over loads pad4096(P_u) + sum over such stepped units pad4096(P_u)
    disk_write += sum over stepped units pad4096(P_u)

A frozen prefix drops the backward (its loads, its gradient edges) of the units below the lowest trainable one.
Sharded over W ranks (torch.distributed initialised), P_u above is this rank's shard of unit u, and the
collectives see whole (padded) units: allgather = the same count of loads times the unit's bytes,
reduce_scatter = the unit's bytes once per gradient offload. Each rank runs its own b*N rows.

`expected_io()` computes these (S from the step: it depends on the family's code; the
tests hold it to what plain autograd saves); the tests hold the counters to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from sltune.runtime import phases
from sltune.runtime.counters import IOCounters
from sltune.runtime.disk.layout import padded

if TYPE_CHECKING:
    from sltune.config import SpeedLoaderConfig
    from sltune.runtime.disk.state import DiskState
    from sltune.runtime.params import ParamStore
    from sltune.runtime.saved import SavedTensors
    from sltune.runtime.disk.weightfiles import WeightFiles


class Stepping(Protocol):
    """What expected_io reads of an engine (sltune.runtime.engine.SpeedLoaderEngine, which calls it: the engine
    imports this module, not the other way round): its config and step plan, and the stores a step moves bytes of."""

    config: SpeedLoaderConfig
    dtype: torch.dtype
    world: int
    lm: torch.nn.Module
    params: ParamStore
    disk: DiskState | None
    weights: WeightFiles | None
    saved: SavedTensors

    def step_plan(self) -> phases.StepPlan: ...


def expected_io(engine: Stepping, seq_len: int) -> IOCounters:
    """The bytes one train_step of `engine` on rows of seq_len tokens should move (a frozen prefix skips its
    backward). Under `activations: offload` the saved-tensor term is the bytes autograd saved on the last step
    (they depend on the family's code; the tests hold them to plain autograd's)."""
    cfg = engine.config
    n, b = cfg.num_sub_batches, cfg.sub_batch_size
    if cfg.schedule == "resident":
        return IOCounters()
    itemsize = torch.empty((), dtype=engine.dtype).element_size()
    step = engine.step_plan()
    trains, plan, loaded, backward = step.trains, step.phases, step.loaded, step.step_order
    loads = sum(u.nbytes for u in loaded)
    # gradients move as the device sums them: float32 under a master (dtype per micro-batch in canonical)
    grad_size = 4 if engine.params.accumulate32 else itemsize
    grads = sum(engine.params.host_grad_numel(u) * grad_size for u in backward)
    gathered = scattered = 0
    if engine.world > 1:   # sharded: the loads above are this rank's shards; collectives see whole units
        gathered = sum(u.padded * itemsize for u in loaded if u.host is not None)
        scattered = sum(u.padded * grad_size for u in backward if u.host is not None and u.has_grads)
    # optimizer_offload disk: every block's file read and written once (its master and optimizer state,
    # padded to pages; the first step reads only the masters: the state does not exist yet)
    disk = engine.disk
    disk_bytes = sum(padded(disk.nbytes(blk, True)) for blk in disk.blocks) if disk is not None else 0
    weight_loads, weight_staged, weight_writes = _weight_files(engine, loaded, backward)
    # param_offload disk, a deferred step: every unit's gradients spilled to a file and read back once
    spill = sum(padded(engine.params.host_grad_numel(u) * grad_size) for u in backward) \
        if engine.params.grads is not None and not step.early else 0
    if cfg.schedule == "canonical":
        return IOCounters(param_load_bytes=n * loads, grad_offload_bytes=n * grads,
                          allgather_bytes=n * gathered, reduce_scatter_bytes=n * scattered,
                          disk_read_bytes=disk_bytes + n * weight_loads + weight_staged,
                          disk_write_bytes=disk_bytes + weight_writes)
    # boundary activations per sub-batch, in edges of b*s*hidden values (phases.edges_moved says which)
    offload = cfg.activations == "offload"
    edges_out, edges_in = phases.boundary_edges(plan, trains, offload)
    edge_bytes = b * seq_len * engine.lm.config.hidden_size * itemsize
    saved = engine.saved.packed_bytes if offload else 0
    return IOCounters(param_load_bytes=loads, grad_offload_bytes=grads, allgather_bytes=gathered,
                      reduce_scatter_bytes=scattered, act_offload_bytes=n * edges_out * edge_bytes + saved,
                      act_load_bytes=n * edges_in * edge_bytes + saved,
                      disk_read_bytes=disk_bytes + weight_loads + weight_staged + spill,
                      disk_write_bytes=disk_bytes + weight_writes + spill)


def _weight_files(engine: Stepping, loaded: list, stepped: list) -> tuple[int, int, int]:
    """param_offload disk (sltune.runtime.disk.weightfiles), in bytes: the files one pass's loads read (canonical runs N
    passes), the files read once more before their unit steps (no master, or frozen values the new copy keeps),
    and the stepped units' new copies written."""
    if engine.weights is None:
        return 0, 0, 0
    reads = sum(padded(u.nbytes) for u in loaded if u.host is not None)
    steps = [u for u in stepped if engine.params.stepped.get(id(u))]
    writes = sum(padded(u.nbytes) for u in steps)
    master = engine.params.master
    staged = sum(padded(u.nbytes) for u in steps
                 if not master or sum(s.numel for s in engine.params.stepped[id(u)]) < u.host.numel())
    return reads, staged, writes
