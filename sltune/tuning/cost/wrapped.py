"""The prior of a wrapped backend's config (DeepSpeed ZeRO, PyTorch FSDP2): its peaks from the model's shape before
any trial, term by term, as sltune.tuning.cost.prior gives SpeedLoader's.

The terms are what the backends' trials allocate, found by bench/wrapped_anatomy.py (the allocations alive at each
trial's measured peak, by the line that made them), not DeepSpeed's estimators, which count the model states all at
once and miss the largest term under optimizer offload. The device is taken at each moment where a trial's
allocations peaked, and its peak is the fullest moment's: the backward (what is held all step, what is gathered and
one micro-batch's activations), the backward's end (the gradients, the activations gone) and the optimizer step.
_deepspeed and _fsdp say which bytes each holds at each moment; written out here so that admitting a spec needs
neither DeepSpeed nor a model.

Activations, one micro-batch of b rows (sltune.tuning.cost.footprint, traced as for SpeedLoader's groups of one layer):
activation checkpointing keeps every decoder layer's input, and the backward holds the larger of one layer's recompute
and backward and the head and loss (the logits in dtype, their float32 upcast and its gradient); activations offload
(save_on_cpu) puts every layer's saved tensors in host memory instead (on the CPU it copies nothing: unpinned, it keeps
a CPU tensor as it is, so they stay the device's). The host holds the trial process, and the model in float32 that every
rank builds before the wrapper takes it (on the CPU that is the device's memory, counted there). On the CPU the device
is host memory: its peak, every rank's, is on the host too. nvme's files are disk (nvme_files, held to
hardware.disk_limit as SpeedLoader's disk tier is): every rank's float32 master, optimizer state and gradient partitions
under offload_optimizer nvme, the weight shards in dtype under offload_param nvme.

Measured (bench/wrapped_anatomy.py, and a grid of trials against `sltune plan`), a trial's device peak being the
larger of its first two steps (the second holds AdamW's state, made at the first): on a qwen2 shape (2 layers,
bfloat16 with float32 masters, seq 128, b 1 and 4, N 1) the device prior is within 8% of all 16 wrapped trials, and
on llama-small (b 2, N 2) within 5% of the five tests/integration/test_prior_against_trials.py holds to 10%. In
float32 on llama-tiny, whose activations and buffers outweigh its weights, it is up to 36% off. The host prior is
up to 28% under these trials (DeepSpeed's process holds more than a SpeedLoader trial's, and what the allocator
keeps of the setup and of freed gradients is not a term): the fits correct it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sltune.backends.export import reduce_bucket
from sltune.tuning.cost.footprint import footprint

if TYPE_CHECKING:
    from sltune.tuning.cost.setup import Setup
    from sltune.tuning.space import Candidate

Terms = list[tuple[str, int]]


def terms(recipe: "Setup", c: "Candidate") -> tuple[Terms, Terms]:
    """(device terms of one rank at its fullest moment, host terms of every rank together, without the device's on the
    CPU) of a deepspeed or fsdp config. The device is taken at each moment of the step where the trials' allocations
    peaked (bench/wrapped_anatomy.py names them), and its peak is the largest: the backward (what is held all step,
    what is gathered and one micro-batch's activations), the backward's end where a backend holds one parameter's
    gradient whole (the activations gone by then), and the optimizer step (what is held, the gradients, the state a
    torch optimizer makes at its first step)."""
    held, moments, host = _states(recipe, c)
    moments[0] = [*moments[0], *_activations(recipe, c, host)]
    device = max(([*held, *moment] for moment in moments), key=lambda ts: sum(n for _, n in ts))
    if not recipe.on_cpu:
        host.append(("the model in float32 every rank builds before the wrapper takes it",
                     recipe.world_size * 4 * recipe.shape.param_bytes // recipe.shape.itemsize))
    return [t for t in device if t[1]], [t for t in host if t[1]]


def model_states(recipe: "Setup", c: "Candidate") -> tuple[Terms, Terms]:
    """The model states alone, every one at once (one rank's device, every rank's host)."""
    held, moments, host = _states(recipe, c)
    return [*held, *(t for moment in moments for t in moment)], host


def nvme_files(recipe: "Setup", c: "Candidate") -> Terms:
    """The files DeepSpeed's nvme offload swaps to, every rank's together (the partitions add up to the model)."""
    if c.backend != "deepspeed":
        return []
    shape = recipe.shape
    count = shape.param_bytes // shape.itemsize
    files: Terms = []
    if c.offload_optimizer == "nvme":
        files += [("float32 master partitions (nvme)", 4 * count),
                  (f"{recipe.optimizer.name} state (float32, nvme)", recipe.optimizer.state_bytes_per_param(4) * count),
                  ("float32 gradient partitions (nvme)", 4 * count)]
    if c.zero_stage == 3 and c.offload_param == "nvme":
        files.append((f"the weights in {shape.dtype} (ZeRO-3 shards, nvme)", shape.itemsize * count))
    return files


def _states(recipe: "Setup", c: "Candidate") -> tuple[Terms, list[Terms], Terms]:
    """(held all step, the moments' own terms (the backward's first), the host's)."""
    return (_deepspeed if c.backend == "deepspeed" else _fsdp)(recipe, c)


NORM_CHUNK = 250_000_000    # ZeRO-3 takes a gradient's norm in chunks of this many values (_constant_buffered_norm2)


def _deepspeed(recipe: "Setup", c: "Candidate") -> tuple[Terms, list[Terms], Terms]:
    """A DeepSpeed config's terms, as its trials allocate them (bench/wrapped_anatomy.py, a qwen2 shape in bfloat16):
    the weights in dtype (every rank's at ZeRO-2, a 1/W shard at ZeRO-3), and sharded over the W ranks the float32
    master and the optimizer's state, held all step; at the step, the float32 gradient partitions beside the dtype ones
    flattened for that copy (and ZeRO-2's averaged dtype partitions). With the optimizer offloaded, master, state and
    float32 gradients are in host memory, and the device's fullest moment is the backward's end: DeepSpeed takes each
    gradient's norm in float64 (its get_norm_dtype) before offloading it, so the largest parameter's gradient (a tied
    embedding's, summed from both its uses) is held whole in dtype beside a float64 copy of its partition. ZeRO-3
    gathers module by module: the largest module's weights and gradients. Accumulating over micro-batches (N > 1),
    ZeRO-2 under offload also holds a copy of every gradient larger than its reduce bucket until the step, and on the
    CPU the device counts the host buffers it accumulates into."""
    shape, world = recipe.shape, max(1, recipe.world_size)
    count, e = shape.param_bytes // shape.itemsize, shape.itemsize
    state = recipe.optimizer.state_bytes_per_param(4)       # DeepSpeed steps float32 partitions
    weights = f"the weights in {shape.dtype}"
    held: Terms = []
    backward: Terms = []
    host: Terms = []
    sizes = [*shape.layer_numels * shape.layers, *shape.embed_numels, *shape.head_numels, *shape.tied_numels]
    largest = max(sizes, default=shape.layer_bytes // e)     # values of the largest parameter
    partitions = [("float32 master partitions", 4 * count), (f"{recipe.optimizer.name} state (float32)", state * count)]
    if c.zero_stage == 3:
        backward.append(("the largest module gathered, weights and gradients", 2 * e * largest))
        if c.offload_param == "none":
            held.append((f"{weights} (ZeRO-3 shards)", -(-e * count // world)))
        elif c.offload_param == "cpu":      # every rank's shard; nvme's are files
            host.append((f"{weights} (ZeRO-3 shards, offloaded)", e * count))
    else:
        held.append((f"{weights} (every rank a copy)", e * count))
    moments = [backward]
    if c.offload_optimizer == "cpu":        # every rank's partitions and float32 gradients (16 bytes with Adam)
        host += [(f"{what} (offloaded)", n) for what, n in [*partitions, ("float32 gradient partitions", 4 * count)]]
    if c.offload_optimizer != "none":       # (nvme's: files)
        part = -(-largest // world)
        part = min(part, NORM_CHUNK) if c.zero_stage == 3 else part
        moments.append([("the largest parameter's gradient", e * largest),
                        ("its partition in float64 for the gradient norm", 8 * part)])
        if c.zero_stage != 3 and c.num_sub_batches > 1:
            # accumulating over micro-batches, ZeRO-2 holds a copy of every gradient larger than its reduce bucket
            # (sltune.backends.export.reduce_bucket) until the step, and accumulates this rank's partition in
            # buffers of host memory made at the first step: the CPU's device counts them, CUDA's does not
            bucket = reduce_bucket(shape.hidden)
            held_over = [(f"the gradients larger than the reduce bucket, copied in {shape.dtype}",
                          e * sum(n for n in sizes if n > bucket))]
            if recipe.on_cpu:
                held_over.append((f"the accumulation buffers of the partition's gradients ({shape.dtype}, host)",
                                  -(-e * count // world)))
            moments.append(held_over)
    else:
        held += [(f"{what} (ZeRO shards)", -(-n // world)) for what, n in partitions]
        step = [("float32 gradient partitions (ZeRO shards)", -(-4 * count // world))]
        if e != 4:      # the step copies flattened dtype partitions to float32 (ZeRO-2 keeps its averaged ones too)
            dtype_partitions = -(-e * count // world)
            if c.zero_stage != 3:
                step.append((f"{shape.dtype} gradient partitions (ZeRO shards)", dtype_partitions))
            step.append((f"{shape.dtype} gradient partitions flattened for that copy", dtype_partitions))
        moments.append(step)
    return held, moments, host


def _fsdp(recipe: "Setup", c: "Candidate") -> tuple[Terms, list[Terms], Terms]:
    """An FSDP2 config's terms, as its trials allocate them (bench/wrapped_anatomy.py): float32 shards of the weights,
    gradients and optimizer state (in host memory under cpu_offload), the root's weights (embedding, head) gathered in
    the compute dtype for the whole step, the decoder layers' gathered while they compute (two, the next one prefetched;
    every one from its forward to its backward when reshard_after_forward is false), and at the backward's end under
    cpu_offload the largest group's reduce-scatter output in float32 before its copy to the host. FSDP2 frees a gathered
    weight by resizing its storage to nothing, which only CUDA's allocator sees: on the CPU every layer's gathered
    weights count from their first use (a trial's first step). Under cpu_offload on the CPU the float32 gradient shards
    it copies to the host each step are allocations of the step, so the device counts them (CUDA's pinned host memory
    would not)."""
    shape, world = recipe.shape, max(1, recipe.world_size)
    count, e = shape.param_bytes // shape.itemsize, shape.itemsize
    compute = 2 if shape.dtype == "bfloat16" else 4          # MixedPrecisionPolicy(bfloat16), else float32
    state = (f"{recipe.optimizer.name} state (float32 shards)", recipe.optimizer.state_bytes_per_param(4) * count)
    shards = [("float32 weight shards", 4 * count), ("float32 gradient shards", 4 * count)]
    root_numel = (shape.embed_bytes + shape.head_bytes + shape.tied_bytes) // e
    layer = shape.layer_bytes // e
    held: Terms = [("the root's weights gathered (embedding, head)", root_numel * compute)]
    backward: Terms = []
    if recipe.on_cpu:       # each layer's gathered storage, freed by resize_(0), stays counted from its first use
        held.append(("every decoder layer's weights gathered (the CPU's tracker sees no resize_(0))",
                     shape.layers * layer * compute))
    elif c.reshard_after_forward is not False:
        backward.append(("decoder layers' weights gathered", 2 * layer * compute))
    else:
        backward.append(("decoder layers' weights gathered, every one from its forward to its backward",
                         shape.layers * layer * compute))
    (weights, w), (grads, g) = shards
    if c.cpu_offload:
        end: Terms = [("the largest group's reduce-scatter output (float32)", 4 * -(-max(layer, root_numel) // world))]
        offloaded = [*shards, state]
        if recipe.on_cpu:       # copied to the host during the step: the device's allocations on the CPU
            end.append((f"{grads} (cpu_offload, copied in the step)", g))
            offloaded = [(weights, w), state]
        return held, [backward, end], [(f"{what} (cpu_offload)", n) for what, n in offloaded]
    held.append((weights, -(-w // world)))
    step = [(grads, -(-g // world)), (state[0], -(-state[1] // world))]
    return held, [backward, step], []


def _activations(recipe: "Setup", c: "Candidate", host: Terms) -> Terms:
    """One micro-batch's activations on the device (and under offload, its saved tensors on the host): every layer's
    checkpointed input, and the larger of one layer's recompute and backward and the head and loss (the logits in
    dtype, their float32 upcast for the loss and its gradient), which activation checkpointing runs one after the
    other."""
    shape = recipe.shape
    fp = footprint(recipe.source, shape.dtype, c.sub_batch_size, recipe.seq_len, 1, 1, "train", resident=False,
                   grads_kept=True, depth=shape.layers)
    head = c.sub_batch_size * recipe.seq_len * shape.vocab * (shape.itemsize + 4 + 4)
    work = ("one layer's recompute and backward, or the head and loss", max(fp.backward, head))
    if c.activations == "offload":
        saved = shape.layers * fp.saved + fp.saved_embed
        if recipe.on_cpu:       # save_on_cpu moves nothing off the CPU: the saved tensors stay the device's
            return [("saved tensors of one micro-batch (activations offload, already on the CPU)", saved), work]
        host.append(("saved tensors of one micro-batch (activations offload)", recipe.world_size * saved))
        return [work]
    return [("every layer's checkpointed input", shape.layers * fp.hidden), work]
