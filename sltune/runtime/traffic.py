"""The traffic one train_step should move, channel by channel: the formulas in sltune.runtime.engine's docstring,
computed by walking the same phase plan a step runs (sltune.runtime.phases). The tests hold the engine's counters
to it, so a change to the schedule that moves other bytes than these fails there."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sltune.runtime import phases
from sltune.runtime.counters import IOCounters
from sltune.runtime.disk_layout import padded

if TYPE_CHECKING:
    from sltune.runtime.engine import SpeedLoaderEngine


def expected_io(engine: "SpeedLoaderEngine", seq_len: int) -> IOCounters:
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


def _weight_files(engine: "SpeedLoaderEngine", loaded: list, stepped: list) -> tuple[int, int, int]:
    """param_offload disk (sltune.runtime.weightfiles), in bytes: the files one pass's loads read (canonical runs N
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
