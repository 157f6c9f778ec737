"""Admitting a spec: the checks that need the model's shape and the cost model, run before a job is created.

Parsing (sltune.tuning.spec) reads a spec; admission decides whether its search can run at all: the model builds,
the workload fits its positions, the backends it sweeps run here (DeepSpeed installed, libaio for its nvme offload),
the space is not empty, and the smallest config (of every backend) fits the memory limits (refused term by term with
what would fit, sltune.tuning.cost.feasible). `tune`, `plan` and POST /tune call it; a stored job is
never admitted again when it is read (a worker resuming it, `export`, GET /jobs/{id}/config.yaml).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sltune.sizes import format_bytes
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import ModelShape, shape_of
from sltune.tuning.space import SearchSpace
from sltune.tuning.spec import TuningSpec


@dataclass(frozen=True)
class Admitted:
    """A spec admission found runnable, with what it built on the way: its model's shape, its search space and the
    prior's recipe. Who goes on to check it against this machine (sltune.service.local.fits_this_machine), against
    a server's ceilings (sltune.service.ceilings) or to plan it takes them from here instead of building them again."""

    spec: TuningSpec
    shape: ModelShape
    space: SearchSpace

    @property
    def setup(self) -> Setup:
        """The memory prior's recipe, without the process a trial runs in (this machine's: with_baseline)."""
        return Setup.of_spec(self.spec, self.shape)

    def with_baseline(self, baseline: int) -> Setup:
        """The recipe with what a trial process holds before its model (sltune.tuning.cost.baseline)."""
        return replace(self.setup, baseline=baseline)


def load(source: str | Path | dict[str, Any], name: str | None = None) -> Admitted:
    """A spec file (or its data) parsed and admitted; errors begin with `name` (default: the file)."""
    if isinstance(source, dict):
        return admitted(TuningSpec.parse(source, source=name or "spec"), name or "spec")
    return admitted(TuningSpec.load(source), name or str(source))


def admitted(spec: TuningSpec, source: str = "spec") -> Admitted:
    """admit(spec), its ValueError as '{source}: {why}'."""
    try:
        return admit(spec)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None


def admit(spec: TuningSpec) -> Admitted:
    """The spec with its shape and space when some config of it can run; else ValueError saying why not (the
    first reason)."""
    try:
        shape = shape_of(spec.model.source, spec.model.dtype)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - a config transformers cannot build is a bad spec
        raise ValueError(f"model: transformers could not build this model: {type(err).__name__}: {err}") from None
    max_pos, tokens = shape.max_positions, spec.workload.tokens_per_row
    if max_pos is not None and tokens > max_pos:
        what = "workload.seq_len" if spec.workload.mode == "train" else "workload.prompt_len + workload.new_tokens"
        raise ValueError(f"{what} = {tokens} exceeds the model's max_position_embeddings {max_pos}; shorten it")
    _backends_run(spec)
    _executor_runs(spec)
    space = SearchSpace(spec, shape)
    if not space.candidates:
        raise ValueError("the search space is empty: no sub_batch_size divides any effective_batch_size; "
                         "widen search.sub_batch_size or search.effective_batch_size")
    ok = Admitted(spec, shape, space)
    _weights_fit(spec, shape, space)
    _memory_fits(ok)
    _probe_depth(spec, shape, space)
    return ok


def _executor_runs(spec: TuningSpec) -> None:
    """hardware.executor ray needs Ray here, an optional extra: one line saying how to install it."""
    if spec.hardware.executor == "ray" and importlib.util.find_spec("ray") is None:
        from sltune.executors import INSTALL_RAY

        raise ValueError(f"hardware.executor: ray is not installed here; install it with `{INSTALL_RAY}`, or use "
                         "hardware.executor local")


def _backends_run(spec: TuningSpec) -> None:
    """The backends the spec sweeps can run trials here: DeepSpeed is an optional extra, and its nvme offload runs
    its async I/O op, built against libaio (sltune.backend_knobs.libaio_found). Each refusal is one line naming the
    field and the fix; the trial folder nvme swaps to is the runner's own, so it is never missing here."""
    from sltune.backend_knobs import libaio_found

    search = spec.search
    if "deepspeed" not in search.backend:
        return
    if importlib.util.find_spec("deepspeed") is None:
        from sltune.backends.deepspeed_ops import INSTALL

        raise ValueError(f"search.backend: deepspeed is not installed here; install it with `{INSTALL}`, or drop "
                         "deepspeed from search.backend")
    for knob, values in search.backend_values("deepspeed").items():
        if "nvme" in values and not libaio_found():
            raise ValueError(f"search.deepspeed.{knob}: nvme needs libaio for DeepSpeed's async I/O (apt-get install "
                             "libaio-dev, then reinstall deepspeed), or use cpu")


def _probe_depth(spec: TuningSpec, shape: ModelShape, space: SearchSpace) -> None:
    """search.probe_layers is for oneshot's training probes, and a number must leave the fits' terms apart:
    at least two groups of the largest num_live_blocks (so G = ceil(L/k) and the (L-k) of the offload
    terms vary as at full depth), and fewer layers than the model has."""
    from sltune.tuning.cost.depth import least_probe_layers

    layers = spec.search.probe_layers
    if layers is None:
        return
    if spec.search.strategy != "oneshot":
        raise ValueError(f"search.probe_layers: only the oneshot strategy runs probes, not "
                         f"{spec.search.strategy}; remove it or set search.strategy: oneshot")
    if spec.workload.mode != "train":
        raise ValueError("search.probe_layers: probes at reduced depth are for training (workload.mode: train); "
                         "remove it")
    if layers == "auto":
        return
    least, k = least_probe_layers(space.k_values), max(space.k_values)
    if least >= shape.layers:
        raise ValueError(f"search.probe_layers: two groups of the largest num_live_blocks ({k}) need {least} "
                         f"layers, and the model has {shape.layers}: no depth in between; remove it or lower "
                         "search.num_live_blocks")
    if layers >= shape.layers:
        raise ValueError(f"search.probe_layers {layers} is not below the model's {shape.layers} decoder layers; "
                         f"give {least} to {shape.layers - 1}, or remove it to probe the whole model")
    if layers < least:
        raise ValueError(f"search.probe_layers {layers} is below two groups of the largest num_live_blocks ({k}); "
                         f"give at least {least} (so the fits can tell per-group from per-layer costs), or "
                         "lower search.num_live_blocks")


def _memory_fits(ok: Admitted) -> None:
    """Refuse limits below what the smallest config is predicted to need (sltune.tuning.cost.prior), term by term
    with what would fit: the device limit per rank, the host limit for all ranks together (trials hold it so).
    The process a trial runs in is left out here (it is this machine's, measured where trials run: tune and
    the server add it), so what is refused here fits nowhere."""
    from sltune.tuning.cost.feasible import shortfall

    hw = ok.spec.hardware
    if hw.host_memory_limit is None and hw.device_memory_limit is None and hw.disk_limit is None:
        return
    short = shortfall(ok.setup, ok.space.candidates, hw.host_memory_limit, hw.device_memory_limit,
                      disk_limit=hw.disk_limit)
    if short:
        raise ValueError(short)


def _weights_fit(spec: TuningSpec, shape: ModelShape, space: SearchSpace) -> None:
    """Refuse shares of the weights that no config can keep on the device under its limit, when keeping
    none would fit: the device holds the kept weights beside the largest unit still streamed in."""
    limit, shares = spec.hardware.device_memory_limit, space.weight_shares
    if limit is None or not shares or shares[0] == 0:
        return
    mode = spec.workload.mode
    least = min((shape.min_device_bytes(mode, k, w), k, w) for k in space.k_values for w in shares)
    keep_none = min(shape.min_device_bytes(mode, k) for k in space.k_values)
    if least[0] > limit >= keep_none:
        need, k, share = least
        raise ValueError(
            f"search.weights_on_device: every share keeps more on the device than hardware.device_memory_limit "
            f"{format_bytes(limit)} holds: the least, {share:g} at num_live_blocks={k}, needs {format_bytes(need)} "
            f"({need} bytes) with the largest unit still streamed in; add a smaller share (0 keeps none) or "
            "raise the limit")
