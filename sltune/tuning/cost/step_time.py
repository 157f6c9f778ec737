"""A config's step time predicted before any trial: the phase plan a SpeedLoader step runs (sltune.runtime.phases,
the plan the engine, its traffic count and the memory prior share) replayed on the engine's lanes over this machine's
calibrated rates (`sltune calibrate`, sltune.machine).

Per phase, per sub-batch of b rows of s tokens, the work is counted from the model's shape:

    compute   each decoder layer's weight matmuls (2 x rows x in x out FLOP each, at the rate calibrated for that
              matrix's shape, interpolated over rows in log space), causal attention (4 x b x heads x s^2 x head_dim),
              ELEMENTWISE_PER_LAYER passes over rows x hidden and MLP_ELEMENTWISE over rows x the MLP's width, two
              RMSNorms; a backward runs, per weight, its input's gradient (the forward's work, transposed) and its
              weight's gradient (out x rows @ rows x in: reduced over the rows, at its own calibrated rate, far
              slower per FLOP at a few rows), and twice the forward's other work; recompute runs the forward again;
              the turnaround runs the last group and the head (hidden x vocab, and LOSS_PASSES over the logits)
              forward and backward at once;
              each sub-batch's gradients are summed into the unit's (one add per parameter)
    memcpy    what sltune.runtime.traffic counts a step moves: each phase's units loaded (the turnaround's and the
              tied weights once), every unit's gradients offloaded once (float32 under a master), each sub-batch's
              boundary activations put and fetched (phases.edges_moved), under activations offload the saved tensors
              of every group below the last both ways; the canonical schedule loads and offloads every unit per
              sub-batch and moves no activations; resident moves nothing
    cpu       the host optimizer over every parameter (its calibrated rate per element), the dtype copy refreshed
              from a float32 master, and OPS_PER_LAYER_PASS ops' fixed cost per layer and pass
    all_gather, reduce_scatter
              over W ranks: every load gathers the whole unit, every gradient offload reduce-scatters it
    disk      optimizer_offload or param_offload disk: the bytes the prior says a step reads and writes
              (Prior.traffic_terms), on a lane of its own (the disk tier's I/O thread), waited for only past the rest

Lanes: on the CPU one thread computes, copies and steps (a memcpy is the CPU's work), so those add up; on a GPU the
copies run on their own stream, a phase's loads prefetched while the phase before it computes, its activations and
gradients copied out while it computes. The fixed costs of a step outside every phase (the runtime's bookkeeping,
"other") are not modelled: trials correct for them.

A wrapped backend's step (DeepSpeed ZeRO, FSDP2) is the same sub-batch's work over the whole model per micro-batch,
with the wrapper's own gathers, reduce-scatters, offload copies and optimizer step (WrappedLanes says which).

In generation the "step" is what a generation trial times: one generate call, the prefill and new_tokens - 1 decode
steps, each walking every unit once (GenerateLanes says what each moves and computes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sltune.runtime import phases
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.workload import layer_widths
from sltune.tuning.space import Candidate

if TYPE_CHECKING:
    from sltune.machine.rates import MachineRates, Rate
    from sltune.tuning.cost.prior import Prior

# TrialResult.breakdown's slices (sltune.profiling.breakdown.SLICES, which loads torch; a test holds them equal)
SLICES = ("compute", "memcpy", "cpu", "all_gather", "reduce_scatter", "disk", "other")
# a decoder layer's forward, counted on llama's (torch.profiler): residual adds, rotary embedding, the attention's
# reshapes and softmax scaling, the MLP's activation and product
ELEMENTWISE_PER_LAYER = 12          # passes over rows x hidden
MLP_ELEMENTWISE = 3                 # passes over rows x the MLP's width
NORMS_PER_LAYER = 2
LOSS_PASSES = 3                     # log-softmax, its gradient, the gather: passes over rows x vocab
OPS_PER_LAYER_PASS = 60             # aten ops a layer's forward dispatches (a backward: twice)
# a generate call's steps, counted on llama-small (TorchDispatchMode; the KV cache's slices and views included): 1,106
# aten ops a decode step at N=1, 1,843 at N=2 (k 1-8, b 1-4 within 5%), so much per layer and sub-batch, and so much
# each step whatever N (the units' walk, the logits, the next tokens)
DECODE_OPS_PER_LAYER = 92
DECODE_OPS_PER_STEP = 360
DEEPSPEED_GRAD_PASSES = 4           # over each gradient every micro-batch, counted in a ZeRO-2 trial's profile
                                    # (llama-small): its norm, its overflow check (amax, amin), its averaging
ENDS = ("median", "low", "high")    # the rates' median, slowest and fastest sample


@dataclass(frozen=True)
class StepTime:
    """One config's predicted step: seconds at the rates' medians, the interval their slowest and fastest samples
    give, and the seconds per slice of TrialResult.breakdown (at the medians)."""

    seconds: float
    slowest: float
    fastest: float
    breakdown: dict[str, float]
    tokens: int                     # per step, every rank's

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def to_dict(self) -> dict[str, object]:
        """As `plan --json` gives it beside each config's peaks."""
        return {"predicted_step_s": self.seconds, "predicted_step_s_interval": [self.fastest, self.slowest],
                "predicted_tokens_per_s": self.tokens_per_s,
                "predicted_tokens_per_s_interval": [self.tokens / self.slowest, self.tokens / self.fastest],
                "predicted_breakdown": {k: v / self.seconds for k, v in self.breakdown.items()}}


class MissingRate(ValueError):
    """The rates hold nothing for a kind of work a config does: calibrate at the spec."""


def step_time(recipe: Setup, c: Candidate, rates: "MachineRates", prior: "Prior | None" = None) -> StepTime:
    """The predicted step of config `c`, SpeedLoader's or a wrapped backend's; in generation one generate call.
    `prior`: a SpeedLoader training config's memory prior, whose disk traffic the disk lane reads (needed under
    optimizer_offload or param_offload disk)."""
    train = recipe.mode == "train"
    if train and c.backend == "speedloader" and (recipe.on_disk(c) or recipe.weights_on_disk(c)) and prior is None:
        raise ValueError("a config on disk needs its prior: its disk traffic is the prior's")
    kind = GenerateLanes if not train else Lanes if c.backend == "speedloader" else WrappedLanes
    lanes = {end: kind(RatesAt(rates, recipe.shape.dtype, end), recipe, c, prior) for end in ENDS}
    median = lanes["median"].play()
    slowest, fastest = lanes["low"].play(), lanes["high"].play()
    tokens = c.batch * (recipe.seq_len if train else recipe.new_tokens) * max(1, recipe.world_size)
    return StepTime(sum(median.values()), sum(slowest.values()), sum(fastest.values()), median, tokens)


class RatesAt:
    """The rates at one end of their spread: the time each kind of work takes."""

    def __init__(self, rates: "MachineRates", dtype: str, end: str):
        self.rates, self.dtype, self.end = rates, dtype, end
        self.matmuls = [m for m in rates.matmul if m.dtype == dtype]
        self.attention = [a for a in rates.attention if a.dtype == dtype]
        if not self.matmuls or not self.attention or dtype not in rates.elementwise:
            measured = sorted({m.dtype for m in rates.matmul}) or ["nothing"]
            raise MissingRate(f"the rates hold no {dtype} matmuls or attention (measured: {', '.join(measured)}); "
                              "calibrate at the spec: sltune calibrate SPEC")

    def _of(self, rate: "Rate") -> float:
        return getattr(rate, self.end)

    def matmul_s(self, rows: int, k: int, n: int) -> float:
        """(rows x k) @ (k x n): at the rate of the calibrated shape nearest (k, n) in size, interpolated over the
        measured row counts in log space (held at the ends beyond them)."""
        size = math.log(k * n)
        same = min(self.matmuls, key=lambda m: (abs(math.log(m.k * m.n) - size), (m.k, m.n) != (k, n)))
        points = sorted((m.rows, self._of(m.flops)) for m in self.matmuls if (m.k, m.n) == (same.k, same.n))
        return 2.0 * rows * k * n / interpolate(points, rows)

    def attention_s(self, batch: int, heads: int, seq: int, head_dim: int) -> float:
        points = sorted((a.batch, self._of(a.flops)) for a in self.attention)
        return 4.0 * batch * heads * seq * seq * head_dim / interpolate(points, batch)

    def decode_attention_s(self, batch: int, heads: int, past: float, head_dim: int) -> float:
        """One query position per row over `past` positions (at the rate calibrated at the longest past)."""
        points = sorted((a.batch, self._of(a.flops)) for a in self.rates.decode_attention if a.dtype == self.dtype)
        if not points:
            raise MissingRate(f"the rates hold no {self.dtype} decode attention; calibrate at a generate spec: "
                              "sltune calibrate SPEC")
        return 4.0 * batch * heads * past * head_dim / interpolate(points, batch)

    def elementwise_s(self, elements: float) -> float:
        return elements / self._of(self.rates.elementwise[self.dtype])

    def norm_s(self, elements: float) -> float:
        rate = self.rates.norm.get(self.dtype) or self.rates.elementwise[self.dtype]
        return elements / self._of(rate)

    def ops_s(self, count: float) -> float:
        return count / self._of(self.rates.op_overhead) if self.rates.op_overhead else 0.0

    def optimizer_s(self, name: str, params: int) -> float:
        """`params` stepped by the optimizer named as calibrate names it ("adamw": torch's, "deepspeed.cpu_adam")."""
        key = name if "." in name else f"torch.{name}"
        rate = self.rates.optimizer.get(key)
        if rate is None:
            raise MissingRate(f"the rates hold no {key} step (measured: "
                              f"{', '.join(self.rates.optimizer) or 'none'}); calibrate at the spec: "
                              "sltune calibrate SPEC")
        return params / self._of(rate)

    def copy_s(self, nbytes: float, direction: str, fresh: bool = False) -> float:
        """Host<->device bytes ('h2d', 'd2h'): pinned where the rates have it; on the CPU a memcpy, into a new
        buffer (`fresh`: its pages faulted in) where the rates have that."""
        copies = self.rates.copies
        rate = copies.get(f"{direction}.pinned") or copies.get(direction) or \
            (copies.get("host.fresh") if fresh else None) or copies.get("host")
        if rate is None:
            raise MissingRate("the rates hold no copy rate; calibrate on this device: sltune calibrate SPEC")
        return nbytes / self._of(rate)

    def disk_s(self, read: float, written: float) -> float:
        if not read and not written:
            return 0.0
        if "read" not in self.rates.disk or "write" not in self.rates.disk:
            raise MissingRate("the rates hold no disk reads and writes; calibrate with --offload-dir where trials "
                              "offload to")
        return read / self._of(self.rates.disk["read"]) + written / self._of(self.rates.disk["write"])

    def collective_s(self, kind: str, world: int, nbytes: float) -> float:
        rate = self.rates.collectives.get(f"{kind}.{world}")
        if rate is None:
            raise MissingRate(f"the rates hold no {kind} over {world} ranks; calibrate with --ranks {world}")
        return nbytes / self._of(rate)


def interpolate(points: list[tuple[int, float]], x: float) -> float:
    """The rate at x between measured (x, rate) points, linear in log x; the end's rate beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, r0), (x1, r1) in zip(points, points[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 1.0
            return r0 + t * (r1 - r0)
    return points[-1][1]


class Lanes:
    """One step of config c replayed phase by phase at one end of the rates; play() gives the seconds per slice."""

    def __init__(self, at: RatesAt, recipe: Setup, c: Candidate, prior: "Prior | None"):
        self.at, self.r, self.c, self.prior = at, recipe, c, prior
        shape = recipe.shape
        self.k = min(c.num_live_blocks or 1, shape.layers)
        full, rest = divmod(shape.layers, self.k)
        self.group_layers = [self.k] * full + ([rest] if rest else [])
        self.rows = c.sub_batch_size * recipe.seq_len
        self.world = max(1, recipe.world_size)

    # -- the work of one sub-batch -------------------------------------------------------------------------------
    def weights(self) -> list[tuple[int, int]]:
        """A decoder layer's weight matrices as (in, out)."""
        hidden = self.r.shape.hidden
        widths = layer_widths(self.r.shape)
        wide = [i for i, w in enumerate(widths) if w > hidden]
        down = wide[-1] if wide else None           # the MLP's down projection maps its width back to hidden
        return [(w, hidden) if i == down else (hidden, w) for i, w in enumerate(widths)]

    def layer_forward_s(self) -> float:
        """One decoder layer's forward over one sub-batch: its matmuls, and its other work (layer_rest_s)."""
        return sum(self.at.matmul_s(self.rows, k, n) for k, n in self.weights()) + self.layer_rest_s()

    def layer_backward_s(self) -> float:
        """One decoder layer's backward over one sub-batch: per weight its input's gradient and its own, and twice
        the forward's other work."""
        at, rows = self.at, self.rows
        grads = sum(at.matmul_s(rows, n, k) + at.matmul_s(n, rows, k) for k, n in self.weights())
        return grads + 2 * self.layer_rest_s()

    def layer_rest_s(self, attention: float | None = None) -> float:
        """A layer's forward work besides its weights' matmuls: attention (causal over seq_len unless given),
        elementwise and norm passes."""
        shape, at, rows = self.r.shape, self.at, self.rows
        head_dim = shape.head_dim or 64
        s = attention if attention is not None else \
            at.attention_s(self.c.sub_batch_size, max(1, shape.hidden // head_dim), self.r.seq_len, head_dim)
        s += at.elementwise_s(ELEMENTWISE_PER_LAYER * rows * shape.hidden
                              + MLP_ELEMENTWISE * rows * max((n for _, n in self.weights()), default=shape.hidden))
        return s + at.norm_s(NORMS_PER_LAYER * rows * shape.hidden)

    def head_forward_s(self) -> float:
        shape = self.r.shape
        return self.at.matmul_s(self.rows, shape.hidden, shape.vocab) + self.at.norm_s(self.rows * shape.hidden)

    def head_backward_s(self) -> float:
        """The logits' gradient into the hidden states and into the head's weight (reduced over the rows)."""
        shape, at = self.r.shape, self.at
        return (at.matmul_s(self.rows, shape.vocab, shape.hidden) + at.matmul_s(shape.vocab, self.rows, shape.hidden)
                + 2 * at.norm_s(self.rows * shape.hidden))

    def loss_s(self) -> float:
        return self.at.elementwise_s(LOSS_PASSES * self.rows * self.r.shape.vocab)

    # -- the step ------------------------------------------------------------------------------------------------
    def play(self) -> dict[str, float]:
        r, c, at, shape = self.r, self.c, self.at, self.r.shape
        n, recompute = c.num_sub_batches, c.activations == "recompute"
        layer, back, head = self.layer_forward_s(), self.layer_backward_s(), self.head_forward_s()
        layer_ops = at.ops_s(OPS_PER_LAYER_PASS)
        plan = phases.plan(len(self.group_layers)) if r.schedule != "resident" else []
        compute: list[float] = []               # per phase, every sub-batch
        cpu_ops: list[float] = []
        for p in plan:
            layers = self.group_layers[p.group] if p.group is not None else 0
            forwards, backwards = {"fwd": (1, 0), "turn": (1, 1), "bwd": (int(recompute), 1)}.get(p.kind, (0, 0))
            passes = forwards + 2 * backwards       # for the ops' fixed costs: a backward dispatches twice as many
            work = layers * (forwards * layer + backwards * back)
            if p.kind == "turn":
                work += head + self.head_backward_s() + self.loss_s()
            elif p.kind in ("embed_fwd", "embed_bwd"):
                work += at.elementwise_s(self.rows * shape.hidden)
            compute.append(n * work)
            cpu_ops.append(n * layers * passes * layer_ops)
        if r.schedule == "resident":
            compute.append(n * (shape.layers * (layer + back) + head + self.head_backward_s() + self.loss_s()))
            cpu_ops.append(n * 3 * shape.layers * layer_ops)
        params = shape.param_bytes // shape.itemsize
        grads_summed = at.elementwise_s(n * params)         # each sub-batch's gradients into the unit's sums
        loads, acts, grads = self.copies(plan)
        optimizer = at.optimizer_s(r.optimizer.name, params // self.world)
        if r.master:                                       # the dtype copy refreshed from the float32 master
            optimizer += at.elementwise_s(params // self.world)
        gathered, scattered = self.collectives(plan)
        disk = 0.0
        if self.prior is not None and self.prior.traffic_terms:
            disk = at.disk_s(self.prior.disk_read, self.prior.disk_written)
        out = dict.fromkeys(SLICES, 0.0)
        out["compute"] = sum(compute) + grads_summed
        out["cpu"] = sum(cpu_ops) + optimizer
        out["all_gather"], out["reduce_scatter"] = gathered, scattered
        if r.on_cpu or not plan:    # one thread computes, copies and steps; resident moves nothing
            out["memcpy"] = sum(loads) + sum(acts) + sum(grads)
        else:                       # a copy stream: loads prefetched a phase ahead, outputs copied under compute
            out["memcpy"] = self.exposed_copies(compute, loads, acts, grads)
        busy = sum(out.values())
        out["disk"] = max(0.0, disk - busy)             # the I/O thread's lane, waited for past the rest
        return out

    def copies(self, plan: list[phases.Phase]) -> tuple[list[float], list[float], list[float]]:
        """Per phase, the seconds of its loads, its activations' traffic and its gradients' offload."""
        r, c, at, shape = self.r, self.c, self.at, self.r.shape
        if r.schedule == "resident":
            return [], [], []
        n = c.num_sub_batches
        per_value = 4 if r.master else shape.itemsize           # gradient sums: float32 under a master
        sub_batches = n if r.schedule == "canonical" else 1     # canonical loads every unit per sub-batch
        trains = [True] * (len(self.group_layers) + 1)
        edge = self.rows * shape.hidden * shape.itemsize
        saved = 0
        if c.activations == "offload" and r.schedule == "speedloader":
            saved = self._saved_bytes()
        loads, acts, grads = [], [], []
        for i, p in enumerate(plan):
            units = [self.unit_bytes(u) for u in p.units]
            nbytes = sum(units) + (shape.tied_bytes if i == 0 else 0)
            loads.append(sub_batches * at.copy_s(nbytes / self.world, "h2d"))
            if p.backward:
                params = (sum(units) + (shape.tied_bytes if i == len(plan) - 1 else 0)) // shape.itemsize
                grad_bytes = params * (shape.itemsize if r.schedule == "canonical" else per_value)
                grads.append(sub_batches * at.copy_s(grad_bytes / self.world, "d2h"))
            else:
                grads.append(0.0)
            if r.schedule == "speedloader":
                put, fetched = phases.edges_moved(p, trains, c.activations == "offload")
                moved = n * (at.copy_s(put * edge, "d2h") + at.copy_s(fetched * edge, "h2d"))
                if saved and p.kind in ("fwd", "bwd"):
                    moved += n * at.copy_s(saved * self.group_layers[p.group], "d2h" if p.kind == "fwd" else "h2d")
                acts.append(moved)
            else:
                acts.append(0.0)
        return loads, acts, grads

    def _saved_bytes(self) -> int:
        """What autograd saves in one layer's forward over one sub-batch, parameters excluded (the footprint's,
        traced on the meta device)."""
        from sltune.tuning.cost.footprint import footprint

        fp = footprint(self.r.source, self.r.shape.dtype, self.c.sub_batch_size, self.r.seq_len, 1, 1, "train",
                       depth=self.r.shape.layers)
        return fp.saved

    def unit_bytes(self, u: phases.Unit) -> int:
        """A phase's unit's parameter bytes: a group's layers, the embedding, the head or the tied weights."""
        shape = self.r.shape
        if isinstance(u, int):
            return self.group_layers[u] * shape.layer_bytes
        return {"embed": shape.embed_bytes, "head": shape.head_bytes, "tied": shape.tied_bytes}[u]

    def collectives(self, plan: list[phases.Phase]) -> tuple[float, float]:
        """Over W ranks: every load gathers its whole unit, every gradient offload reduce-scatters it."""
        if self.world == 1 or self.r.schedule == "resident":
            return 0.0, 0.0
        shape, at = self.r.shape, self.at
        loaded = sum(self.unit_bytes(u) for u in phases.loaded(plan))
        grads = shape.param_bytes // shape.itemsize * (4 if self.r.master else shape.itemsize)
        sub_batches = self.c.num_sub_batches if self.r.schedule == "canonical" else 1
        return (sub_batches * at.collective_s("all_gather", self.world, loaded),
                sub_batches * at.collective_s("reduce_scatter", self.world, grads))

    @staticmethod
    def exposed_copies(compute: list[float], loads: list[float], acts: list[float], grads: list[float]) -> float:
        """The copy stream's time the compute waits for: phase p's loads start once the copy stream is free and
        phase p-1 has started (one phase of prefetch), phase p starts once they are in and phase p-1 is done, and
        its activations and gradients go out on the copy stream while it computes."""
        copy_free = compute_free = started = 0.0
        for p, work in enumerate(compute):
            load_end = max(copy_free, started) + loads[p]
            started = max(compute_free, load_end)
            compute_free = started + work
            copy_free = max(load_end, started) + acts[p] + grads[p]
        return max(compute_free, copy_free) - sum(compute)


class WrappedLanes(Lanes):
    """One step of a DeepSpeed ZeRO or FSDP2 config (sltune.backends): N micro-batches of b rows, each the whole
    model's forward and backward (the forward again under activation checkpointing), then one optimizer step.

    Per micro-batch, besides the compute a SpeedLoader sub-batch runs (the same work functions), the wrapper moves
    the weights and gradients as its schedule does:
        ZeRO   every micro-batch copies each gradient into the reduce bucket, passes over it DEEPSPEED_GRAD_PASSES
               times (its norm, its overflow check, its averaging), reduce-scatters it and casts its partition to
               float32 in a new buffer (in host memory under offload_optimizer: a copy);
        ZeRO-3 gathers every module's weights in dtype for its forward and again for its backward; under
               offload_param cpu each gather first copies the shard to the device;
        ZeRO-2 holds the weights whole and all-gathers the updated ones after the step;
        FSDP2  gathers each decoder layer's weights in the compute dtype (cast from their float32 shards) for its
               forward and, under reshard_after_forward, again for its backward; the root's (embedding, head) once;
               accumulates the unsharded gradients without sync and reduce-scatters them in float32 on the last
               micro-batch; under cpu_offload a gather copies the shard to the device and the gradient goes back.
    Over one rank a gather or a reduce-scatter is a copy (FSDP2 and ZeRO-3 still copy into and out of their flat
    buffers). The optimizer steps float32 partitions of 1/W of the parameters: DeepSpeedCPUAdam under
    offload_optimizer cpu (where calibrate timed it), the spec's torch optimizer otherwise; DeepSpeed then copies the
    float32 masters back to the weights' dtype. offload_optimizer nvme reads the
    masters and the optimizer's state from their files and writes them back each step, with the gradients; ZeRO-3's
    offload_param nvme reads the weights' shards for every gather (a disk lane of its own, waited for past the rest).

    Lanes: on the CPU they add up. On a GPU the wrappers prefetch gathers and overlap reduce-scatters with the
    backward, so collectives and copies cost only what exceeds the compute. The wrappers' per-module hooks are
    fixed costs ("other"), not modelled: trials correct for them (sltune.tuning.cost.correction).
    """

    def play(self) -> dict[str, float]:
        r, c, at, shape = self.r, self.c, self.at, self.r.shape
        n, layers, world = c.num_sub_batches, shape.layers, self.world
        recompute = c.activations == "recompute"
        e = shape.itemsize
        params = shape.param_bytes // e
        shard = -(-params // world)
        layer = self.layer_forward_s()
        forward = layers * layer + self.head_forward_s()
        backward = layers * self.layer_backward_s() + self.head_backward_s() + self.loss_s()
        embed = 2 * at.elementwise_s(self.rows * shape.hidden)         # the lookup and its gradient's scatter
        micro = forward + backward + embed + (layers * layer if recompute else 0.0)
        out = dict.fromkeys(SLICES, 0.0)
        out["compute"] = n * micro
        out["cpu"] = n * layers * (3 + int(recompute)) * at.ops_s(OPS_PER_LAYER_PASS)
        moved = self.deepspeed(params, shard) if c.backend == "deepspeed" else self.fsdp(params, shard)
        extra_compute, optimizer, copies, gathered, scattered, disk = moved
        out["compute"] += extra_compute
        if c.offload_optimizer not in (None, "none") or c.cpu_offload:
            out["cpu"] += optimizer         # stepped on the host (the trial's breakdown says so too)
        else:
            out["compute"] += optimizer
        if r.on_cpu:
            out["memcpy"], out["all_gather"], out["reduce_scatter"] = copies, gathered, scattered
        else:       # prefetched gathers, reduce-scatters under the backward: only what exceeds the compute shows
            hidden = out["compute"]
            for name, seconds in (("memcpy", copies), ("all_gather", gathered), ("reduce_scatter", scattered)):
                out[name] = max(0.0, seconds - hidden)
                hidden = max(0.0, hidden - seconds)
        out["disk"] = max(0.0, disk - sum(out.values()))
        return out

    def _collective_s(self, kind: str, nbytes: float) -> float:
        """An all-gather or reduce-scatter of nbytes over the ranks; nothing over one rank."""
        return self.at.collective_s(kind, self.world, nbytes) if self.world > 1 else 0.0

    def deepspeed(self, params: int, shard: int) -> tuple[float, float, float, float, float, float]:
        """(compute besides the layers', the optimizer, copies, all-gathers, reduce-scatters, disk) of a ZeRO
        step, in seconds."""
        r, c, at, shape = self.r, self.c, self.at, self.r.shape
        n, e = c.num_sub_batches, shape.itemsize
        offload = c.offload_optimizer not in (None, "none")
        name = r.optimizer.name
        if c.offload_optimizer == "cpu" and name == "adamw" and "deepspeed.cpu_adam" in at.rates.optimizer:
            name = "deepspeed.cpu_adam"
        optimizer = at.optimizer_s(name, shard)
        # every micro-batch, each gradient is copied into the reduce bucket, passed over DEEPSPEED_GRAD_PASSES
        # times, reduce-scattered (over one rank: nothing more), and its partition cast to float32 in a new buffer
        # (under offload in host memory: copies); at the step the masters are copied back to the dtype
        compute = n * (at.elementwise_s(DEEPSPEED_GRAD_PASSES * params) + at.copy_s(e * params, "d2h"))
        compute += at.elementwise_s(shard)
        cast = n * at.copy_s(4 * shard, "d2h", fresh=True)
        if offload:
            copies = cast + at.copy_s(e * shard, "h2d")
        else:
            compute, copies = compute + cast, 0.0
        scattered = n * self._collective_s("reduce_scatter", e * params)
        disk = 0.0
        if c.zero_stage == 3:
            gathers = n * 2 * e * params                 # every module's weights, forward and backward
            gathered = self._collective_s("all_gather", gathers) if self.world > 1 else at.copy_s(gathers, "h2d")
            if c.offload_param == "cpu":
                copies += at.copy_s(gathers / self.world, "h2d")
            elif c.offload_param == "nvme":
                disk += at.disk_s(gathers / self.world, 0)
        else:
            gathered = self._collective_s("all_gather", e * params)           # the updated partitions
        if c.offload_optimizer == "nvme":
            state = (4 + r.optimizer.state_bytes_per_param(4)) * shard
            disk += at.disk_s(state, state + 4 * shard)
        return compute, optimizer, copies, gathered, scattered, disk

    def fsdp(self, params: int, shard: int) -> tuple[float, float, float, float, float, float]:
        """The same of an FSDP2 step."""
        r, c, at, shape = self.r, self.c, self.at, self.r.shape
        n, e = c.num_sub_batches, shape.itemsize
        compute_bytes = 2 if shape.dtype == "bfloat16" else 4       # MixedPrecisionPolicy(bfloat16), else float32
        layer, root = shape.layer_bytes // e, (shape.embed_bytes + shape.head_bytes + shape.tied_bytes) // e
        per_micro = (1 + int(c.reshard_after_forward is not False)) * shape.layers * layer + root
        gathers = n * per_micro * compute_bytes     # over one rank still copied into and out of the flat buffer
        gathered = self._collective_s("all_gather", gathers) if self.world > 1 else at.copy_s(gathers, "h2d")
        compute = (n - 1) * at.elementwise_s(params)                    # accumulating without sync
        if compute_bytes != 4:
            compute += at.elementwise_s(n * per_micro / self.world)     # the shards cast to bfloat16 to gather
            compute += at.elementwise_s(params)                         # the gradients cast to float32 to reduce
        # the gradients concatenated into a new float32 buffer, reduce-scattered, the shard copied out (new too)
        scattered = at.copy_s(4 * params, "d2h", fresh=True) + at.copy_s(4 * shard, "d2h", fresh=True) \
            + self._collective_s("reduce_scatter", 4 * params)
        copies = 0.0
        if c.cpu_offload and not r.on_cpu:          # on the CPU the shards are where the compute is
            copies = at.copy_s(4 * n * per_micro / self.world, "h2d") + at.copy_s(4 * shard, "d2h")
        return compute, at.optimizer_s(r.optimizer.name, shard), copies, gathered, scattered, 0.0


class GenerateLanes(Lanes):
    """One generate call of config c (sltune.runtime.generate): the prefill over prompt_len tokens a row, then
    new_tokens - 1 decode steps of one token a row, each walking the units once (embedding, the groups, the head)
    with every sub-batch run through each while it is loaded.

    Per forward step, per sub-batch: each decoder layer's matmuls at its rows (b x prompt_len at the prefill, b at a
    decode step), its attention (causal over the prompt; a decode step's one position over the past, at the mean past
    of the call's decode steps: its work is linear in it), its elementwise and norm passes and its ops' fixed costs;
    the head over each row's last position, and the next tokens picked from the float32 logits; each step's own ops
    besides (DECODE_OPS_PER_STEP). Moved each step, as
    GenerationStats counts it: every unit's weights but those weights_on_device keeps (they load at the prefill
    only), per sub-batch under canonical, nothing resident; each group's boundary activations (speedloader); the new
    keys and values into KV caches in host memory, read where they lie on the CPU, and on a GPU staged per group
    and sub-batch (the past copied in). param_offload disk reads the streamed units' files each step on the I/O lane,
    read ahead. Lanes: on the CPU they add up; on a GPU a unit loads while the one before it computes."""

    def __init__(self, at: RatesAt, recipe: Setup, c: Candidate, prior: "Prior | None"):
        super().__init__(at, recipe, c, prior)
        shape = recipe.shape
        groups = [(f"group{i}", k * shape.layer_bytes) for i, k in enumerate(self.group_layers)]
        self.walk = [("embed", shape.embed_bytes), *groups, ("head", shape.head_bytes)]     # the order a step runs
        self.kept = shape.kept_units(self.k, c.weights_on_device or 0.0)
        self.tied = shape.tied_bytes

    def loaded(self, decode: bool) -> list[int]:
        """Per unit in walking order, the bytes one step loads (the tied weights with the embedding): every unit at
        the prefill, the ones weights_on_device does not keep at a decode step."""
        sizes = [0 if decode and name in self.kept else nbytes for name, nbytes in self.walk]
        sizes[0] += 0 if decode and "tied" in self.kept else self.tied
        return sizes

    def play(self) -> dict[str, float]:
        r = self.r
        decodes = r.new_tokens - 1
        out = dict.fromkeys(SLICES, 0.0)
        for rows, past, times in ((self.c.sub_batch_size * r.prompt_len, 0.0, 1),
                                  (self.c.sub_batch_size, r.prompt_len + decodes / 2, decodes)):
            if not times:
                continue
            compute, loads, moved, ops, gathered = self.forward_step(rows, past)
            out["compute"] += times * sum(compute)
            out["cpu"] += times * ops
            out["all_gather"] += times * gathered
            if r.on_cpu or r.schedule == "resident":
                out["memcpy"] += times * (sum(loads) + sum(moved))
            else:
                out["memcpy"] += times * self.exposed_copies(compute, loads, moved, [0.0] * len(compute))
        if r.weights_on_disk(self.c):
            read = sum(self.loaded(decode=False)) + decodes * sum(self.loaded(decode=True))
            out["disk"] = max(0.0, self.at.disk_s(read / self.world, 0) - sum(out.values()))
        return out

    def forward_step(self, rows: int, past: float) -> tuple[list[float], list[float], list[float], float, float]:
        """(compute per unit, loads per unit, activations' and KV copies per unit, ops' fixed costs, all-gathers)
        of one forward step at `rows` a sub-batch: the prefill (past 0) or a decode step over `past` positions."""
        r, c, at, shape = self.r, self.c, self.at, self.r.shape
        n, b = c.num_sub_batches, c.sub_batch_size
        head_dim = shape.head_dim or 64
        heads, q = max(1, shape.hidden // head_dim), rows // b
        self.rows = rows
        attention = at.decode_attention_s(b, heads, past + 1, head_dim) if past else \
            at.attention_s(b, heads, q, head_dim)
        layer = sum(at.matmul_s(rows, k, w) for k, w in self.weights()) + self.layer_rest_s(attention)
        head = at.matmul_s(b, shape.hidden, shape.vocab) + at.norm_s(b * shape.hidden)
        compute = [n * at.elementwise_s(rows * shape.hidden),                  # the embedding's lookup
                   *(n * layers * layer for layers in self.group_layers),
                   n * head + at.elementwise_s(2 * n * b * shape.vocab)]       # logits to float32, the next tokens
        loads = [0.0] * len(compute)
        if r.schedule != "resident":
            per_step = n if r.schedule == "canonical" else 1
            loads = [per_step * at.copy_s(nbytes / self.world, "h2d") for nbytes in self.loaded(decode=past > 0)]
        edge = rows * shape.hidden * shape.itemsize
        kv_new = 2 * rows * (shape.kv_heads or heads) * head_dim * shape.itemsize    # a layer's new keys and values
        moved = [0.0] * len(compute)
        for g, layers in enumerate(self.group_layers, start=1):
            if r.schedule == "speedloader":                 # its input fetched, its output put, per sub-batch
                moved[g] += n * (at.copy_s(edge, "h2d") + at.copy_s(edge, "d2h"))
            if not c.kv_on_device and r.schedule != "resident":
                moved[g] += n * layers * at.copy_s(kv_new, "d2h")
                if not r.on_cpu and past:                   # staged on the device: the past copied in
                    moved[g] += n * layers * at.copy_s(kv_new * past, "h2d")
        gathered = 0.0
        if self.world > 1 and r.schedule != "resident":
            gathered = at.collective_s("all_gather", self.world, sum(self.loaded(decode=past > 0)))
        ops = at.ops_s(DECODE_OPS_PER_STEP + n * shape.layers * DECODE_OPS_PER_LAYER)
        return compute, loads, moved, ops, gathered
