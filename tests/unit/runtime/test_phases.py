"""One phase plan (sltune.runtime.phases): the engine runs it, its expected traffic counts it and the tuner's prior
replays it. These fail when any of the three walks another order than the plan."""

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.runtime import phases
from sltune.tuning.cost import prior
from sltune.tuning.cost.prior import predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.space import Candidate
from tests.support.reference import adamw

SEQ = 8
RUNS = {"_embed_forward": "embed_fwd", "_group_forward": "fwd", "_turnaround": "turn", "_group_backward": "bwd",
        "_embed_backward": "embed_bwd"}
TRAIN_STEP = prior.play_train_step


def kinds(plan):
    return [(p.kind, p.group) for p in plan]


def engine_of(k: int, frozen=(), activations="recompute") -> SpeedLoaderEngine:
    model = build("llama-tiny")                     # 4 layers, untied
    for name in frozen:
        model.get_submodule(name).requires_grad_(False)
    return SpeedLoaderEngine(model, SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=2, num_live_blocks=k,
                                                      activations=activations), optimizer=adamw)


def run_phases(engine: SpeedLoaderEngine) -> list[tuple[str, int | None]]:
    """The phases one train_step actually runs, in order, with the group each runs."""
    ran = []
    for name, kind in RUNS.items():
        real = getattr(engine, name)

        def record(*args, real=real, kind=kind):
            group = next((a.index for a in args if hasattr(a, "unit")), None)
            ran.append((kind, group))
            return real(*args)
        setattr(engine, name, record)
    engine.train_step(torch.randint(3, 512, (2, SEQ), generator=torch.Generator().manual_seed(0)))
    return ran


def test_the_plan_by_hand():
    assert kinds(phases.plan(3)) == [("embed_fwd", None), ("fwd", 0), ("fwd", 1), ("turn", 2), ("bwd", 1),
                                     ("bwd", 0), ("embed_bwd", None)]
    assert [p.units for p in phases.plan(2)] == [("embed",), (0,), (1, "head"), (0,), ("embed",)]
    assert kinds(phases.plan(1)) == [("embed_fwd", None), ("turn", 0), ("embed_bwd", None)]
    # group 0 and the embedding frozen: a gradient flows back to edge 2 (group 1's input), not below it
    trains = phases.trained_edges(False, [False, True, False, True])
    assert trains == [False, False, True, True, True]
    assert kinds(phases.plan(4, trains)) == [("embed_fwd", None), ("fwd", 0), ("fwd", 1), ("fwd", 2), ("turn", 3),
                                             ("bwd", 2), ("bwd", 1)]
    assert phases.step_order(phases.plan(4, trains)) == [3, "head", 2, 1, "tied"]


@pytest.mark.parametrize("groups", [1, 2, 3, 5])
def test_the_edges_counted_are_the_documented_formulas(groups):
    """sltune.runtime.engine's docstring: recompute puts 2G edges and fetches 3G-1; offload puts and fetches 2G."""
    plan = phases.plan(groups)
    trains = [True] * (groups + 1)
    assert phases.boundary_edges(plan, trains, offload=False) == (2 * groups, 3 * groups - 1)
    assert phases.boundary_edges(plan, trains, offload=True) == (2 * groups, 2 * groups)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_the_engine_runs_the_plan(k):
    engine = engine_of(k)
    step = engine.step_plan()
    trains, plan = list(step.trains), list(step.phases)
    assert trains == [True] * (len(engine.groups) + 1)
    assert plan == phases.plan(len(engine.groups))
    assert run_phases(engine) == kinds(plan)
    last = engine.groups[-1]        # the turnaround's units (the last group and the head) finish their gradients first
    assert list(step.step_order) == [last.unit, engine.head, *(g.unit for g in reversed(engine.groups[:-1])),
                                     engine.embed, engine.tied]


@pytest.mark.parametrize("activations", ["recompute", "offload"])
@pytest.mark.parametrize("frozen", [["model.embed_tokens"], ["model.embed_tokens", "model.layers.0"],
                                    ["model.layers.1"]])
def test_a_partly_frozen_engine_runs_the_plan_of_its_trained_edges(frozen, activations):
    engine = engine_of(1, frozen, activations)
    step = engine.step_plan()
    trains, plan = list(step.trains), list(step.phases)
    expected = phases.trained_edges(not frozen[0] == "model.embed_tokens",
                                    [not any(f == f"model.layers.{g}" for f in frozen) for g in range(4)])
    assert trains == expected
    assert plan == phases.plan(4, expected)
    assert run_phases(engine) == kinds(plan)
    assert engine.io == engine.expected_io(SEQ)          # the traffic walks the same phases


def played(monkeypatch, k: int, model="llama-tiny", schedule="speedloader") -> list[phases.Phase]:
    """The phases the prior's device timeline plays for one config."""
    seen: list[phases.Phase] = []
    monkeypatch.setattr(prior, "play_train_step", lambda *args: seen.extend(TRAIN_STEP(*args)))
    predict(Setup(model, shape_of(model), schedule=schedule, seq_len=SEQ), Candidate(1, 2, k))
    return seen


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_the_prior_plays_the_engines_plan(monkeypatch, k):
    assert played(monkeypatch, k) == list(engine_of(k).step_plan().phases)


def test_the_prior_plays_three_body_groups_of_a_deeper_model(monkeypatch):
    """Equal body groups repeat the same buffers: the prior plays the plan over three of them and the last."""
    assert played(monkeypatch, 1, "llama-small") == phases.plan(4)
    assert played(monkeypatch, 1, "llama-tiny", "canonical") == phases.plan(4)
    assert played(monkeypatch, 1, "llama-tiny", "resident") == []
