"""The phases of one SpeedLoader training pass, in the order they run: one plan that the engine runs
(SpeedLoaderEngine._pass), that its expected traffic counts (sltune.runtime.traffic) and that the tuner's prior
replays (sltune.tuning.cost.prior), so the three cannot drift apart. No torch here: the prior imports it (through
the cost model) without paying for torch.

With G groups (group G-1 the last), a pass is

    embed_fwd                  the embedding
    fwd        g = 0..G-2      each group below the last, once, every sub-batch through it
    turn       g = G-1         the last group and the head live together: forward, loss and backward at once
    bwd        g = G-2..0      each group below the last in reverse, where a gradient must flow through it
    embed_bwd                  the embedding, where it or the tied weights train

Group edge e is group e's input (edge 0 the embedding's output); `trains[e]` says whether a gradient must flow back
to it. A frozen prefix (fine-tuning the top layers) has False there: no backward, no loads, no copies for it. The
tied weights are live through the whole pass and are no phase's unit; they make their gradients final last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, Union

Unit = Union[int, str]                      # a group's index, or "embed", "head", "tied"
BACKWARD: tuple[str, ...] = ("turn", "bwd", "embed_bwd")


@dataclass(frozen=True)
class Phase:
    """One phase: its kind, the group it runs (None for the embedding's) and the units live in it."""

    kind: str
    group: int | None
    units: tuple[Unit, ...]

    @property
    def backward(self) -> bool:
        """Whether the phase makes gradients: its units take gradient buffers and offload them after it."""
        return self.kind in BACKWARD


@dataclass(frozen=True)
class StepPlan:
    """What one train_step of an engine runs, as a value (SpeedLoaderEngine.step_plan): its phases and which group
    edges carry a gradient back, the engine's units a pass loads and the order a step makes their gradients final,
    and whether each unit steps as soon as they are (else after the whole backward). The traffic a step should move
    (sltune.runtime.traffic) is counted from it, not from the engine's insides."""

    trains: tuple[bool, ...]
    phases: tuple[Phase, ...]
    loaded: tuple[Any, ...]         # the engine's units (sltune.runtime.params.ParamUnit), tied once per pass
    step_order: tuple[Any, ...]
    early: bool


def trained_edges(embed: bool, groups: Sequence[bool]) -> list[bool]:
    """Per group edge 0..G, whether a gradient must flow back to it: once a trainable parameter sits below it.
    `embed`: the embedding (or the tied weights) trains; `groups[g]`: group g does."""
    edges = [embed]
    for trains in groups:
        edges.append(edges[-1] or trains)
    return edges


def plan(groups: int, trains: Sequence[bool] | None = None) -> list[Phase]:
    """The phases of a pass over `groups` groups; `trains` per group edge 0..G (trained_edges), None: all train."""
    if groups < 1:
        raise ValueError(f"a pass needs at least one group, got {groups}")
    edges = [True] * (groups + 1) if trains is None else list(trains)
    if len(edges) != groups + 1:
        raise ValueError(f"trains needs one entry per group edge ({groups + 1}), got {len(edges)}")
    body, last = range(groups - 1), groups - 1
    return ([Phase("embed_fwd", None, ("embed",))] + [Phase("fwd", g, (g,)) for g in body]
            + [Phase("turn", last, (last, "head"))]
            + [Phase("bwd", g, (g,)) for g in reversed(body) if edges[g + 1]]
            + ([Phase("embed_bwd", None, ("embed",))] if edges[0] else []))


def loaded(phases: Sequence[Phase]) -> list[Unit]:
    """The units a pass loads, once per phase they are live in: the tied weights once for the whole pass."""
    return [u for p in phases for u in p.units] + ["tied"]


def step_order(phases: Sequence[Phase]) -> list[Unit]:
    """The units in the order a pass makes their gradients final (and an early optimizer step may take them):
    the backward's, the tied weights last."""
    return [u for p in phases if p.backward for u in p.units] + ["tied"]


def edges_moved(phase: Phase, trains: Sequence[bool], offload: bool) -> tuple[int, int]:
    """Boundary activations one sub-batch moves in a phase, in edges of b*s*hidden values: (put to the host,
    fetched back). Forward puts each group's input and fetches it once; the turnaround puts its input's gradient
    where one must flow; a group's backward fetches its output's gradient (and, recomputing, its input: under
    `offload` its saved tensors come back instead) and puts its input's gradient where one must flow; the
    embedding's backward fetches its output's gradient."""
    if phase.kind == "embed_fwd":
        return 1, 0
    if phase.kind == "fwd":
        return 1, 1
    if phase.kind == "turn":
        return int(trains[phase.group]), 1
    if phase.kind == "bwd":
        return int(trains[phase.group]), 1 if offload else 2
    return 0, 1


def boundary_edges(phases: Sequence[Phase], trains: Sequence[bool], offload: bool) -> tuple[int, int]:
    """The edges one sub-batch puts and fetches over a whole pass (edges_moved summed)."""
    moved = [edges_moved(p, trains, offload) for p in phases]
    return sum(o for o, _ in moved), sum(i for _, i in moved)
