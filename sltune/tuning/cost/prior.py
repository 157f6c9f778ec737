"""A config's host and device peaks predicted from the model's shape before any trial: the tuner's prior.

Term by term, as the runtime allocates them:

    host    the weights in dtype; training adds the float32 master (mixed precision in bfloat16/float16), the
            gradients (float32 under a master, else dtype), the optimizer's state (AdamW two moments, SGD with
            momentum one buffer, in the dtype it steps); the boundary activations every sub-batch leaves at every
            group edge (speedloader: G*N*b*s*hidden*itemsize; generation (G+1) edges of the prompt); under
            activations: offload every sub-batch's saved tensors of every group below the last (twice: the first
            step's slabs, one per tensor, stay with the allocator when later steps pack one per group); generation's
            KV caches when they live on the host (2*L*B*T*kv_heads*head_dim*itemsize); on the CPU, where the
            device is host memory, the device's buffers (below) with what the pool keeps of them for reuse; and
            the process itself (python, torch and transformers, what a trial holds before its model:
            sltune.tuning.cost.baseline measures it). Under optimizer_offload disk the master and the optimizer
            state leave host memory for files; the host holds the window instead (sltune.runtime.disk.state: the
            DEPTH largest blocks' master and state, page-padded) and, from the first step, the optimizer's fresh
            state of the largest block, allocated before it is copied into its slot. Under param_offload disk
            (in training with the optimizer on disk; over W ranks each rank's shards) neither the dtype weights
            nor the gradients are whole
            in host memory (sltune.runtime.disk.weightfiles): the weights' window holds the units read ahead (the
            engine reads one phase ahead: the largest two neighbouring phases' units), SPARE free buffers (none) and, in
            training, STAGED stepped copies (one stepping, WRITES_IN_FLIGHT written behind), as many of the
            largest units page-padded; the gradients' window (sltune.runtime.disk.gradwindow) the GRAD_UNITS largest
            units' gradient sums (float32 under a master, else dtype), page-padded, but under the canonical
            schedule, which sums every micro-batch's gradients on the host and keeps them whole; the device's
            buffers take no prefetched unit (its file is read ahead instead). Formulas like the rest, of what the
            runtime allocates at most: the fits correct them from the trials
    disk    optimizer_offload disk: every block's file (master and state, page-padded) twice, since a step
            writes the new version beside the committed one and removes the old files only once it commits (under
            disk_versions 1 once, and the DEPTH largest blocks' new files in flight: each old file goes as its new
            one lands); param_offload disk: every unit's weights file (dtype, page-padded), in training twice for
            the same reason (disk_versions 1: once, and the largest unit's new file in flight), and when a step
            waits for every gradient (float16's loss scaling, clipping, or no float32 master: the step could not be
            undone part-way) the gradients spilled to files meanwhile
    traffic per step, on disk (predicted, a formula; trials count the bytes they move: TrialResult.io): the disk
            tier reads and writes every block once; param_offload disk reads each unit's weights file at every
            load (each unit twice, forward and backward, but the last group and the head, live together once;
            the canonical schedule N times that), once more before it steps where the step needs its values (no
            float32 master), writes each stepped unit's new version once, and a waiting step writes its
            gradients and reads them back (sltune.runtime.traffic counts the same for a running engine)
    device  the step played phase by phase as the engine runs it (the plan of sltune.runtime.phases): the units live
            in each phase (a group, the embedding, the head, the tied weights all pass) with their gradient
            buffers in backward (under a float32 master the float32 sums, the dtype gradients being autograd's own,
            in the traced compute), the next phase's units prefetched, the
            boundary activations in flight (this sub-batch's, the next one's, the last one's output), the layer
            arguments each sub-batch's prologue recorded, and what the phase's compute allocates for one
            sub-batch (sltune.tuning.cost.footprint, traced on the meta device); resident keeps everything on the
            device, its optimizer state too; generation adds the kept weights and a device KV cache

Every term is a byte formula or a traced count; nothing is fitted. Trials measure the host peak as the trial's
resident memory (all ranks together) and the device peak as the runtime's tracker (CPU) or the allocator's
reserved bytes (CUDA, where fragmentation comes on top: the fits correct for it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sltune.runtime import phases
from sltune.runtime.disk.layout import DEPTH, pack, padded, pieces
from sltune.tuning.cost import wrapped
from sltune.tuning.cost.footprint import Footprint, footprint
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import ModelShape
from sltune.tuning.space import Candidate

# param_offload disk's window (sltune.runtime.disk.weightfiles, which imports torch: the prior does not): the free
# buffers it keeps for reuse (none), the stepped copies staged at once (one being stepped, WRITES_IN_FLIGHT = 1 written
# behind), and the units whose gradient sums host memory holds at once, its budget the largest ones'
# (sltune.runtime.disk.gradwindow); the tests hold them to the runtime
SPARE = 0
STAGED = 2
GRAD_UNITS = 2


@dataclass
class Prior:
    """Predicted peaks of one config, each with its terms (what, bytes), largest binding first in a message."""

    host: int
    device: int
    host_terms: list[tuple[str, int]]
    device_terms: list[tuple[str, int]]
    disk: int = 0                   # optimizer_offload or param_offload disk, DeepSpeed's nvme: the files at their
    disk_terms: list[tuple[str, int]] = field(default_factory=list)     # fullest (else 0)
    # SpeedLoader's files: (what, bytes read, bytes written) per step, a formula (TrialResult.io measures them)
    traffic_terms: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def disk_read(self) -> int:
        return sum(r for _, r, _ in self.traffic_terms)

    @property
    def disk_written(self) -> int:
        return sum(w for _, _, w in self.traffic_terms)

    def to_dict(self) -> dict[str, Any]:
        traffic = {"disk_read_bytes_per_step": self.disk_read, "disk_write_bytes_per_step": self.disk_written,
                   "disk_traffic_terms": {what: {"read": r, "written": w} for what, r, w in self.traffic_terms}}
        return {"peak_host_bytes": self.host, "peak_device_bytes": self.device,
                "host_terms": dict(self.host_terms), "device_terms": dict(self.device_terms),
                **({"peak_disk_bytes": self.disk, "disk_terms": dict(self.disk_terms)} if self.disk else {}),
                **(traffic if self.traffic_terms else {})}


def predict(recipe: Setup, c: Candidate) -> Prior:
    """The prior of one config; W ranks together for the host (as trials hold the host limit), one rank's
    device. A deepspeed or fsdp config's is sltune.tuning.cost.wrapped's."""
    if c.backend != "speedloader":
        return _wrapped(recipe, c)
    shape, world = recipe.shape, max(1, recipe.world_size)
    b, n, k = c.sub_batch_size, c.num_sub_batches, min(c.num_live_blocks, shape.layers)
    train = recipe.mode == "train"
    tokens = recipe.seq_len if train else recipe.prompt_len
    groups = _group_layers(shape.layers, k)
    fp = footprint(recipe.source, shape.dtype, b, tokens, k, groups[-1], recipe.mode,
                   resident=recipe.schedule == "resident", grads_kept=_grads_kept(recipe),
                   depth=shape.layers)
    device = _Timeline()
    if train:
        play_train_step(device, recipe, c, groups, fp)
    else:
        _generate_step(device, recipe, c, groups, fp)

    host: list[tuple[str, int]] = []
    on_disk, weights_on_disk = recipe.on_disk(c), recipe.weights_on_disk(c)
    disk: list[tuple[str, int]] = []
    traffic: list[tuple[str, int, int]] = []
    if recipe.schedule != "resident":   # resident keeps these on the device: among its buffers below
        host += [(what, _sharded(nbytes, world))
                 for what, nbytes in shape.host_terms(recipe.mode, recipe.mixed_precision, recipe.optimizer)
                 if not (on_disk and what.startswith(("a float32 master", "AdamW", "SGD")))
                 and not (weights_on_disk and what.startswith("the weights in"))]
    if on_disk:
        host_window, disk, moved = _disk_terms(recipe, k)
        host += host_window
        traffic.append(("the disk tier's blocks (master and state)", moved, moved))
    if weights_on_disk and recipe.schedule != "canonical":    # canonical sums every micro-batch's on the host
        host = [(what, n) for what, n in host if not what.endswith(" gradients")]
    if weights_on_disk:
        host_window, files, moved = _weight_terms(recipe, c, groups)
        host += host_window
        disk += files
        traffic += moved
    acts = 0
    if recipe.schedule == "speedloader":
        edges = len(groups) if train else len(groups) + 1
        acts = edges * n * fp.hidden
    if acts:
        host.append(("boundary activations", world * acts))
    if train and c.activations == "offload" and recipe.schedule == "speedloader":
        saved = world * n * ((len(groups) - 1) * fp.saved + fp.saved_embed)
        host.append(("saved tensors (offload)", saved))
        # the first step packs a slab per tensor (no layout known yet), later steps one per sub-batch and group:
        # the first ones are freed as the later come, and the allocator keeps their pages
        host.append(("the first step's saved-tensor slabs, kept by the allocator", saved))
    if not train and not c.kv_on_device and recipe.schedule != "resident":
        host.append(("KV caches", _kv_bytes(shape, b * n, recipe.prompt_len + recipe.new_tokens)))
    if recipe.on_cpu:       # the device is this memory: its buffers, and what the pool keeps of them
        host.append(("device buffers", world * device.held_peak))
    host.append(("the process", recipe.baseline))
    return Prior(host=sum(x for _, x in host), device=device.peak, host_terms=host,
                 device_terms=device.peak_terms, disk=sum(x for _, x in disk), disk_terms=disk, traffic_terms=traffic)


def _wrapped(recipe: Setup, c: Candidate) -> Prior:
    """A wrapped backend's prior (sltune.tuning.cost.wrapped's terms), with the device's buffers in host memory on the
    CPU and the trial process, as SpeedLoader's."""
    device, host = wrapped.terms(recipe, c)
    peak = sum(n for _, n in device)
    if recipe.on_cpu:
        host.append(("device buffers", max(1, recipe.world_size) * peak))
    host.append(("the process", recipe.baseline))
    disk = wrapped.nvme_files(recipe, c)
    return Prior(host=sum(n for _, n in host), device=peak, host_terms=host,
                 device_terms=sorted(device, key=lambda t: -t[1]), disk=sum(n for _, n in disk), disk_terms=disk)


def disk_blocks(shape: ModelShape, k: int, world: int = 1) -> list[list[int]]:
    """The values of each block optimizer_offload disk packs, per rank (sltune.runtime.disk.state.add_unit): each
    unit's trainable tensors in order, at most BLOCK_NUMEL values a block (a larger tensor is a block of its own);
    over W ranks each rank steps one flat shard per unit (sltune.runtime.sharding)."""
    def tensors(numels: tuple[int, ...], nbytes: int) -> list[int]:
        return list(numels) if numels else ([nbytes // shape.itemsize] if nbytes else [])

    layer = tensors(shape.layer_numels, shape.layer_bytes)
    units = [tensors(shape.tied_numels, shape.tied_bytes), tensors(shape.embed_numels, shape.embed_bytes),
             *(layer * g for g in _group_layers(shape.layers, k)), tensors(shape.head_numels, shape.head_bytes)]
    units = [u for u in units if sum(u)]
    if world > 1:
        ranks = []
        for r in range(world):
            mine = []
            for u in units:
                total = sum(u)
                shard = -(-total // world)
                mine.append([max(0, min(shard, total - r * shard))])
            ranks.append([n for m in mine for n in _block_sizes(m) if n])
        return ranks
    return [[n for u in units for n in _block_sizes(u)]]


def _block_sizes(numels: list[int]) -> list[int]:
    """The disk tier's blocks of these tensors, sliced and packed as sltune.runtime.disk.state lays them out."""
    return [sum(block) for block in pack([n for numel in numels for _, n in pieces(numel)], int)]


def _disk_terms(recipe: Setup, k: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]], int]:
    """optimizer_offload disk: what host memory holds for it (all ranks together), the files at their fullest
    (every rank's) and the bytes of one version (what a step reads and writes)."""
    per_value = recipe.disk_value_bytes
    step = 4 if recipe.master else recipe.shape.itemsize
    state = recipe.optimizer.state_bytes_per_param(step)
    window = fresh = files = 0
    for blocks in disk_blocks(recipe.shape, k, max(1, recipe.world_size)):
        if not blocks or not per_value:
            continue
        window += sum(sorted((padded(n * per_value) for n in blocks), reverse=True)[:DEPTH])
        fresh += state * max(blocks)
        files += sum(padded(n * per_value) for n in blocks)
    host = [(f"the disk tier's window ({DEPTH} blocks' master and state)", window),
            ("the optimizer's fresh state of the largest block (first step)", fresh)]
    disk = [("the committed version's files", files)]
    if recipe.disk_versions == 1:   # a block's new file lands before its old one goes: the window's in flight
        disk.append((f"the new files of the blocks in flight ({DEPTH} at most: disk_versions 1)", window))
    else:
        disk.append(("the new version a step writes before it commits", files))
    return [t for t in host if t[1]], [t for t in disk if t[1]], files


def _weight_terms(recipe: Setup, c: Candidate, groups: list[int]) -> tuple[list[tuple[str, int]],
                                                                           list[tuple[str, int]],
                                                                           list[tuple[str, int, int]]]:
    """param_offload disk: what host memory holds for the weights and the gradients instead of the whole model, the
    weights' files (and a waiting step's spilled gradients), and the traffic of one step (a training step;
    generation's per decoding step), each a formula the fits correct. Over W ranks each rank reads, holds and writes
    its 1/W shard of each unit (sltune.runtime.sharding): the figures are all ranks' together."""
    shape, e = recipe.shape, recipe.shape.itemsize
    world = max(1, recipe.world_size)
    embed, tied, units, head = _units(shape, groups)
    every = [u for u in (tied, embed, *units, head) if u.nbytes]
    shard = {u.name: -(-(u.nbytes // e) // world) for u in every}      # a rank's values of each unit
    sizes = {u.name: padded(shard[u.name] * e) for u in every}
    # the buffers held at once are distinct units' (the window reuses a free buffer that holds a unit, and keeps the
    # SPARE largest free ones): the largest units' sizes bound them
    largest = sorted(sizes.values(), reverse=True)
    files = sum(sizes.values())
    if recipe.mode == "train":
        plan = phases.plan(len(units))
        named = {"embed": embed.name, "head": head.name, "tied": tied.name}

        def name(u: phases.Unit) -> str:
            return f"group{u}" if isinstance(u, int) else named[u]
        reads = [[name(u) for u in p.units] for p in plan]
        # the tied weights load with the first phase, for the whole pass: their read is in the window before any
        # gradient exists. On the CPU (the device is this memory) that moment holds less than the backward's peak,
        # whose device buffers (a host term there) include the tied weights' gradient sums, at least their bytes: so
        # their read never adds to the peak there. Where the device is elsewhere it may be the window's peak
        if not recipe.on_cpu:
            reads[0] = [tied.name, *reads[0]]
        loads = sum(sizes.get(name(u), 0) for u in phases.loaded(plan))
        if recipe.schedule == "canonical":      # every micro-batch loads every unit
            loads *= c.num_sub_batches
    else:   # a decoding step loads every unit once (weights kept on the device included: an upper bound)
        reads = [[tied.name, embed.name], *[[u.name] for u in units], [head.name]]
        loads = files
    ahead = max(sum(sizes.get(n, 0) for n in now + after) for now, after in zip(reads, reads[1:] + [[]]))
    host = [("the weights' window: units read ahead (param_offload disk)", ahead),
            *([(f"the weights' window: {SPARE} spare buffers", sum(largest[:SPARE]))] if SPARE else [])]
    disk = [("the weights' files (param_offload disk)", files)]
    traffic = [("the weights read at each load", loads, 0)]
    if recipe.mode == "train":
        grads = [padded(shard[u.name] * recipe.grad_bytes) for u in every]
        spill = sum(grads)
        host.append((f"the weights' window: {STAGED} stepped copies staged", sum(largest[:STAGED])))
        if recipe.schedule != "canonical":      # canonical keeps every micro-batch's sum whole (a host term above)
            host.append((f"the gradients' window: the {GRAD_UNITS} largest units' (param_offload disk)",
                         sum(sorted(grads, reverse=True)[:GRAD_UNITS])))
        disk.append(("the weights' new version a step writes before it commits", files) if recipe.disk_versions != 1
                    else ("the new weights file in flight (disk_versions 1)", largest[0]))
        # a step without a master updates the dtype copy in place: each unit's file is read once more to step it
        traffic.append(("each stepped unit's new weights", 0 if recipe.master else files, files))
        if recipe.deferred and recipe.schedule != "canonical":     # canonical's gradients stay whole in memory
            disk.append(("the gradients a waiting step spills (loss scaling, clipping, no master)", spill))
            traffic.append(("the gradients a waiting step spills and reads back", spill, spill))
    if world > 1:
        host = [(what, world * n) for what, n in host]
        disk = [(what, world * n) for what, n in disk]
        traffic = [(what, world * r, world * w) for what, r, w in traffic]
    return host, disk, traffic


def at_depth(shape: ModelShape, layers: int) -> ModelShape:
    """The shape with `layers` decoder layers (a probe at reduced depth): the widths kept, the parameters fewer."""
    return dataclasses.replace(shape, layers=layers,
                               param_bytes=shape.param_bytes - (shape.layers - layers) * shape.layer_bytes)


def _sharded(nbytes: int, world: int) -> int:
    """Bytes of a term every rank holds 1/W of (each unit padded to a multiple of W values: negligible)."""
    return nbytes if world == 1 else world * -(-nbytes // world)


def _group_layers(layers: int, k: int) -> list[int]:
    full, rest = divmod(layers, k)
    return [k] * full + ([rest] if rest else [])


def _kv_bytes(shape: ModelShape, rows: int, positions: int) -> int:
    return 2 * shape.layers * rows * positions * shape.kv_heads * shape.head_dim * shape.itemsize


class _Timeline:
    """The engine's device buffers through one step, taken and given back as the engine does, from a pool that
    keeps what is given back for reuse (sltune.runtime.params.BufferPool): the device's peak (what is live, as
    the tracker counts it) and what the process holds for the device at its fullest (on the CPU the pool's
    buffers stay resident, live or not)."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[str, int, tuple[int, int]]] = {}  # name -> (what, bytes, pool key)
        self.free: dict[tuple[int, int], int] = {}
        self.held = 0               # bytes the pool holds, live or free
        self.static: list[tuple[str, int]] = []     # buffers outside the pool (resident weights, device KV)
        self.peak = 0
        self.peak_terms: list[tuple[str, int]] = []
        self.held_peak = 0

    def take(self, name: str, what: str, nbytes: int, size: int = 0) -> None:
        if name in self.live or nbytes <= 0:
            return
        key = (nbytes, size)
        if self.free.get(key):
            self.free[key] -= 1
        else:
            self.held += nbytes
        self.live[name] = (what, nbytes, key)

    def give(self, name: str) -> None:
        if name in self.live:
            _, _, key = self.live.pop(name)
            self.free[key] = self.free.get(key, 0) + 1

    def relabel(self, name: str, what: str) -> None:
        if name in self.live:
            _, nbytes, key = self.live[name]
            self.live[name] = (what, nbytes, key)

    def moment(self, compute: list[tuple[str, int]], unseen: int = 0) -> None:
        """A point in the step where the phase's compute holds `compute` on top of the live buffers, and `unseen`
        bytes the device's tracker does not see (a kernel's own temporaries) but the process holds."""
        terms: dict[str, int] = {}
        for what, nbytes in [*self.static, *((w, n) for w, n, _ in self.live.values()), *compute]:
            if nbytes:
                terms[what] = terms.get(what, 0) + nbytes
        total = sum(terms.values())
        if total > self.peak:
            self.peak, self.peak_terms = total, sorted(terms.items(), key=lambda t: -t[1])
        self.held_peak = max(self.held_peak,
                             self.held + sum(n for _, n in self.static) + sum(n for _, n in compute) + unseen)


@dataclass
class _Unit:
    name: str
    nbytes: int


def _units(shape: ModelShape, groups: list[int]) -> tuple[_Unit, _Unit, list[_Unit], _Unit]:
    """The engine's units (sltune.runtime.engine._build_units): embedding, groups of layers, head, tied weights."""
    return (_Unit("embed", shape.embed_bytes), _Unit("tied", shape.tied_bytes),
            [_Unit(f"group{i}", g * shape.layer_bytes) for i, g in enumerate(groups)], _Unit("head", shape.head_bytes))


def _grads_kept(r: Setup) -> bool:
    """Whether the device's dtype gradients are buffers autograd adds into (sltune.runtime.params): not under a
    float32 master on the speedloader schedule (autograd's own, added into the float32 sums and dropped after every
    sub-batch), nor on the resident schedule without one (autograd's own until the step)."""
    if r.master:
        return r.schedule != "speedloader"
    return r.schedule != "resident"


def _in_flight(n: int, per_sub_batch: int) -> int:
    """Boundary activations live while a sub-batch computes: its own, the next one's (fetched ahead) and the
    last one's output (still bound until this one's replaces it): three from N=3 on."""
    return min(n, 3) * per_sub_batch


def _play_resident(t: _Timeline, r: Setup, fp: Footprint) -> None:
    """The resident schedule's step: the whole model's weights (and gradients, master and state) on the device, plain
    autograd over one sub-batch at a time."""
    shape, e = r.shape, r.shape.itemsize
    count = shape.param_bytes // e
    t.static = [("weights", shape.param_bytes)]
    if r.master:
        t.static += [("float32 master", 4 * count), ("float32 gradients", 4 * count),
                     (f"{shape.dtype} gradients", shape.param_bytes)]
    grads = 0 if r.master else shape.param_bytes   # autograd's own: live from the first backward to the step
    t.moment([("compute of one sub-batch (whole model)", fp.resident)])
    if r.master:    # each unit's dtype gradients added into its float32 sum: a float32 copy of them first
        t.moment([], unseen=4 * max(shape.layer_bytes, shape.embed_bytes, shape.head_bytes, shape.tied_bytes) // e)
    state = r.optimizer.state_bytes_per_param(4 if r.master else e) * count
    t.moment([("gradients", grads), ("optimizer state", state)])


def play_train_step(t: _Timeline, r: Setup, c: Candidate, groups: list[int], fp: Footprint) -> list[phases.Phase]:
    """The step's device buffers played into `t`; the phases played, in order (none under resident, which runs
    plain autograd): the engine's plan, with no frozen prefix."""
    shape, e = r.shape, r.shape.itemsize
    embed, tied, units, head = _units(shape, _compressed(groups))
    if r.schedule == "resident":
        _play_resident(t, r, fp)
        return []
    n = c.num_sub_batches if r.schedule == "speedloader" else 1
    offload = c.activations == "offload"
    from_files = r.weights_on_disk(c)
    accumulate32 = r.master and r.schedule != "canonical"
    prologue_kept = c.num_sub_batches * fp.kept       # every sub-batch's layer arguments, all step

    def activate(u: _Unit) -> None:
        t.take(u.name, "weights being used", u.nbytes, e)
        t.relabel(u.name, "weights being used")

    def prefetch(u: _Unit) -> None:
        if not from_files:      # param_offload disk reads the file ahead: the device buffer waits for the activation
            t.take(u.name, "weights prefetched", u.nbytes, e)

    def begin_grads(u: _Unit) -> None:
        if accumulate32:        # the dtype gradients are autograd's own: in the traced backward (footprint)
            t.take(u.name + ".grad32", "float32 gradient sums", u.nbytes // e * 4, 4)
        else:
            t.take(u.name + ".grad", "gradients", u.nbytes, e)

    def release(u: _Unit) -> None:
        for suffix in ("", ".grad", ".grad32"):
            t.give(u.name + suffix)

    plan = phases.plan(len(units))     # the engine's plan, over the groups _compressed keeps
    named = {"embed": embed, "head": head, "tied": tied}
    lives = [[units[u] if isinstance(u, int) else named[u] for u in phase.units] for phase in plan]
    device_acts = r.schedule == "canonical"
    G = len(groups)
    a = fp.hidden
    if offload and r.schedule == "speedloader":
        # the first step loaded the saved tensors back tensor by tensor (no slab layout yet): the pool keeps those
        # buffers, this sub-batch's and the next's, beside the later steps' whole slabs
        t.held += 2 * fp.saved
    activate(tied)
    begin_grads(tied)
    played: list[phases.Phase] = []
    for idx, phase in enumerate(plan):
        kind, live = phase.kind, lives[idx]
        played.append(phase)
        for u in live:
            activate(u)
        if idx + 1 < len(plan):
            for u in lives[idx + 1]:
                prefetch(u)
        if phase.backward:
            for u in live:
                begin_grads(u)
        kept = ("layer arguments of every sub-batch", prologue_kept)
        if kind == "embed_fwd":
            compute = [("prologue of one sub-batch", fp.prologue),
                       ("layer arguments of every sub-batch", (c.num_sub_batches - 1) * fp.kept),
                       ("activations in flight", a * (n > 1))]
        elif kind == "fwd":
            work = fp.held_forward if offload else fp.forward
            compute = [kept, ("activations in flight", _in_flight(n, a)), ("one group's compute", work)]
        elif kind == "turn":
            compute = [kept, ("activations in flight", _in_flight(n, a)), ("last group, head and loss", fp.turnaround)]
        elif kind == "bwd":
            if offload:
                saved = 2 * fp.saved if r.schedule == "speedloader" else fp.saved
                compute = [kept, ("activations in flight", 2 * a if n > 1 else a), ("saved tensors loaded", saved),
                           ("one group's backward", max(fp.backward - fp.held_forward, 0))]
            else:
                flight = 2 * a if n == 1 else (4 * a if n == 2 else 5 * a)
                compute = [kept, ("activations in flight", flight), ("one group's recompute and backward", fp.backward)]
        else:
            compute = [kept, ("activations in flight", 2 * a if n > 1 else a),
                       ("embedding backward", fp.embed_backward)]
        if device_acts:      # canonical: the boundary activations (and under offload the saved tensors) stay here
            compute.append(("boundary activations", G * a))
            if offload:
                compute.append(("saved tensors", (G - 1) * fp.saved))
        t.moment(compute)
        if r.master and phase.backward:
            # on the CPU, adding dtype gradients into float32 ones (the sum over sub-batches; canonical's on the
            # host) first casts them to a float32 temporary inside the kernel, which the tracker cannot see
            summed = [u.nbytes for u in live] + ([tied.nbytes] if kind != "bwd" else [])
            t.moment([kept, ("activations in flight", _in_flight(n, a))], unseen=4 * max(summed) // e)
        for u in live:
            release(u)
    release(tied)
    return played


def _compressed(groups: list[int]) -> list[int]:
    """The body groups repeat the same phases with the same buffers: three of them show every peak the step
    reaches (a group's neighbours on both sides), so a 80-layer model plays no longer than a 4-layer one."""
    *body, last = groups
    return body[:3] + [last] if len(set(body)) <= 1 else groups


def _generate_step(t: _Timeline, r: Setup, c: Candidate, groups: list[int], fp: Footprint) -> None:
    """The prefill, the step that holds the most: every unit loaded once (kept ones stay), every sub-batch's
    prompt through it, the last position's logits of every sub-batch."""
    shape, e = r.shape, r.shape.itemsize
    b, n = c.sub_batch_size, c.num_sub_batches
    a = fp.hidden
    if c.kv_on_device or r.schedule == "resident":
        t.static.append(("KV caches", _kv_bytes(shape, b * n, r.prompt_len + r.new_tokens)))
    if r.schedule == "resident":
        t.static.append(("weights", shape.param_bytes))
    embed, tied, units, head = _units(shape, groups)
    kept = shape.kept_units(groups[0], c.weights_on_device or 0.0)
    m = 1 if r.schedule == "canonical" else n      # canonical: one sub-batch per pass, the earlier ones' logits held
    ahead = not r.on_cpu and not r.weights_on_disk(c)     # param_offload disk reads ahead into host memory only
    logits = 4 * b * shape.vocab                    # the last position's, in float32, kept to the step's end
    seq = [embed, *units, head]
    if r.schedule != "resident":
        t.take(tied.name, "weights being used", tied.nbytes, e)
    for i, u in enumerate(seq):
        if r.schedule != "resident":
            t.take(u.name, "weights being used", u.nbytes, e)
            t.relabel(u.name, "weights being used" if u.name not in kept else "weights kept on the device")
            if ahead and i + 1 < len(seq):
                t.take(seq[i + 1].name, "weights prefetched", seq[i + 1].nbytes, e)
        args = ("layer arguments of every sub-batch", n * fp.kept)
        if u is embed:
            compute = [("prologue of one sub-batch", fp.prologue),
                       ("layer arguments of every sub-batch", (n - 1) * fp.kept),
                       ("activations in flight", a * (m > 1))]
        elif u is head:
            compute = [args, ("activations in flight", a), ("last-position logits of every sub-batch", n * logits),
                       ("one sub-batch's logits in dtype", b * shape.vocab * e)]
        else:
            compute = [args, ("activations in flight", _in_flight(m, a)), ("one group's compute", fp.forward)]
        t.moment(compute)
        if u.name not in kept:
            t.give(u.name)
