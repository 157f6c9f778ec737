"""The configs a job may try: sub-batch size b, sub-batches N (or effective batch B = b*N), live blocks k, how a group's
backward gets its activations (recompute or offload), in training where the optimizer's master and state live (host
memory or files on disk), where the dtype copy of the weights lives (param_offload: host memory, or files read ahead
into a window; in training only beside the optimizer on disk), and for generation where the KV caches live and the share
of the weights kept on the device (w). A job sweeping several backends (search.backend) searches the union of their
spaces: b, N (or B) and activations are every backend's (a wrapped backend's micro-batch and accumulation steps), the
rest SpeedLoader's; DeepSpeed and FSDP2 candidates carry their own knobs instead (sltune.backend_knobs)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import optuna

from sltune.backend_knobs import ALL_KNOBS, DEFAULTS, KNOBS, BackendChoice
from sltune.config import BACKEND_FIELDS, param_offload_refusal
from sltune.tuning.knobs import knob_values

if TYPE_CHECKING:
    from sltune.tuning.spec import TuningSpec


class Layered(Protocol):
    """What the space reads of a model's shape (sltune.tuning.cost.shape.ModelShape, a room above): its layers."""

    layers: int


KV_ORDER = ("host", "device")     # device KV needs more device memory, and moves nothing
OFFLOAD_ORDER = ("disk", "host")  # host holds the master and optimizer state in memory: more host, no disk traffic
                                  # (the weights' place, param_offload, is ordered alike)

# what a candidate of a wrapped backend carries of SpeedLoader's knobs (its micro-batch, its accumulation steps and
# its activations), and what a trial's config records even at its default (the rest only away from it, as results
# recorded before the knob read)
WRAPPED_FIELDS = ("sub_batch_size", "num_sub_batches", "activations")
ALWAYS_RECORDED = (*WRAPPED_FIELDS, "num_live_blocks")


@functools.total_ordering
@dataclass(frozen=True)
class Candidate(BackendChoice):
    """One config of the search, its fields named as the knobs they set (sltune.config.RuntimeKnobs), so that a
    trial's config, Optuna's parameters and best.yaml read them without translation; then what trains it and that
    backend's knobs (BackendChoice, keyword-only; num_live_blocks None under another backend). The paper's b, N and
    k are only how it prints (str)."""

    sub_batch_size: int
    num_sub_batches: int
    num_live_blocks: int | None     # SpeedLoader's live blocks; None under another backend
    activations: str = "recompute"
    kv_cache: str | None = None     # generation only: "host" | "device"
    weights_on_device: float | None = None  # generation only: the share of the weights kept there
    optimizer_offload: str = "host"  # training: the master and optimizer state in host memory, or in files ("disk")
    param_offload: str = "host"      # the dtype copy of the weights in host memory, or in files read ahead ("disk")

    @classmethod
    def from_knobs(cls, knobs: dict[str, Any]) -> "Candidate":
        """A candidate from its knobs, a stored trial's config or a result's: a config of another backend names it
        and has its knobs (num_live_blocks None); one without a backend is SpeedLoader's. A knob the config leaves
        out takes the field's default (results recorded before the knob existed)."""
        backend = knobs.get("backend") or "speedloader"
        own = {f.name: knobs[f.name] for f in fields(cls) if knobs.get(f.name) is not None
               and f.name not in BACKEND_FIELDS}
        if backend != "speedloader":
            own = {name: own[name] for name in WRAPPED_FIELDS if name in own}
            return cls(**own, num_live_blocks=None, backend=backend,
                       **{knob: knobs.get(knob, DEFAULTS[knob]) for knob in KNOBS[backend]})
        return cls(**own)

    def _order(self) -> tuple:
        """Field by field, None first: a backend's candidates have None where another's have values, and sorting
        a union space must not compare None with a number (within one backend the order is the fields' own)."""
        return tuple((0,) if v is None else (1, v) for v in (getattr(self, f.name) for f in fields(self)))

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Candidate):
            return NotImplemented
        return self._order() < other._order()

    @property
    def batch(self) -> int:
        return self.sub_batch_size * self.num_sub_batches

    @property
    def kv_on_device(self) -> bool:
        return self.kv_cache == "device"

    def knobs(self, named: bool = False) -> dict[str, Any]:
        """As a trial's config names them: SpeedLoader's as before there were backends, a knob left out at its
        default (`named`: with its backend too, as in a job of several); another backend's with its name and knobs,
        and num_live_blocks None (as TrialResult.config has it)."""
        if self.backend != "speedloader":
            return {**{name: getattr(self, name) for name in (*WRAPPED_FIELDS, "num_live_blocks")},
                    "backend": self.backend, **self.backend_knobs()}
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in BACKEND_FIELDS
               and (f.name in ALWAYS_RECORDED or getattr(self, f.name) != f.default)}
        return {**out, "backend": self.backend} if named else out

    @property
    def on_disk(self) -> bool:
        """The optimizer's master and state in files (optimizer_offload disk)."""
        return self.optimizer_offload == "disk"

    @property
    def weights_on_disk(self) -> bool:
        """The dtype copy of the weights in files (param_offload disk)."""
        return self.param_offload == "disk"

    @property
    def uses_disk(self) -> bool:
        """SpeedLoader keeps files for it (the optimizer's, the weights' or both): the disk limit holds them."""
        return self.on_disk or self.weights_on_disk

    @property
    def offloads(self) -> int:
        """How many of the optimizer and the weights live in files: 0, 1 or 2 (fewer moves less)."""
        return int(self.on_disk) + int(self.weights_on_disk)

    @property
    def writes_files(self) -> bool:
        """Whether its trial needs an offload folder: SpeedLoader's optimizer or weights on disk, or DeepSpeed's nvme
        offload."""
        return self.uses_disk or "nvme" in (self.offload_optimizer, self.offload_param)

    def dominates(self, other: "Candidate") -> bool:
        """At least as large in sub-batch, effective batch and live blocks, activations kept alike, KV on the device if
        the other's is, at least its share of the weights kept there, the optimizer (and the weights) in host memory if
        the other's are: needs at least as much device memory (and, moving less, runs no slower; disk's reads and writes
        come on top of the same step). Across backends, or across a backend's own knobs (whose memory and speed trade
        against each other), no config dominates another."""
        if self.backend != other.backend or self.backend_knobs() != other.backend_knobs():
            return False
        larger = self.sub_batch_size >= other.sub_batch_size and self.batch >= other.batch \
            and self.activations == other.activations and self != other
        if self.backend != "speedloader":
            return larger
        return larger and self.num_live_blocks >= other.num_live_blocks and self.kv_on_device >= other.kv_on_device \
            and (self.weights_on_device or 0.0) >= (other.weights_on_device or 0.0) \
            and self.on_disk <= other.on_disk and self.weights_on_disk <= other.weights_on_disk

    def __str__(self) -> str:
        if self.backend != "speedloader":
            return " ".join([self.backend, f"b={self.sub_batch_size} N={self.num_sub_batches}",
                             *([self.activations] if self.activations != "recompute" else []),
                             *(f"{knob}={str(v).lower() if isinstance(v, bool) else v}"
                               for knob, v in self.backend_knobs().items())])
        return (f"b={self.sub_batch_size} N={self.num_sub_batches} k={self.num_live_blocks}"
                + ("" if self.activations == "recompute" else f" {self.activations}")
                + (f" kv_cache={self.kv_cache}" if self.kv_cache else "")
                + (f" w={self.weights_on_device:g}" if self.weights_on_device is not None else "")
                + (f" optimizer_offload={self.optimizer_offload}" if self.optimizer_offload != "host" else "")
                + (f" param_offload={self.param_offload}" if self.param_offload != "host" else ""))


class SearchSpace:
    """Every valid candidate, and how Optuna names them.

    Optuna sees categorical parameters: sub_batch_size and num_live_blocks, plus num_sub_batches or
    effective_batch_size as the spec gives them (N = B/b when B is the knob), activations when the spec sweeps
    it, optimizer_offload when the spec sweeps it (training), param_offload when the spec sweeps it, and kv_cache and
    weights_on_device for generation. A combination that is not a candidate (b does not divide B; in training the
    weights on disk with the optimizer in host memory, which the runtime refuses) is pruned without running.

    Sweeping several backends, a trial's first parameter is `backend`, and the rest are conditional on it (Optuna's
    define-by-run): num_live_blocks and SpeedLoader's other knobs for speedloader, each DeepSpeed or FSDP knob the
    spec sweeps (more than one value) for its backend. A spec of one backend has no `backend` parameter, and a
    SpeedLoader-only spec's parameters are the ones above, so its stored studies resume.
    """

    def __init__(self, spec: "TuningSpec", shape: Layered):
        s = spec.search
        self.b_values = knob_values(s.sub_batch_size, "sub_batch_size")
        self.k_values = sorted({min(k, shape.layers) for k in knob_values(s.num_live_blocks, "num_live_blocks")})
        self.activation_values = list(s.activations)
        self.by_batch = s.effective_batch_size is not None
        if self.by_batch:
            self.batch_values = knob_values(s.effective_batch_size, "effective_batch_size")
            pairs = [(b, bb // b) for b in self.b_values for bb in self.batch_values if bb % b == 0]
        else:
            self.n_values = knob_values(s.num_sub_batches, "num_sub_batches")
            pairs = [(b, n) for b in self.b_values for n in self.n_values]
        self.kv_values = s.kv_cache_values(spec.workload.mode)
        self.weight_shares = s.weights_on_device_values(spec.workload.mode)
        self.offload_values = s.optimizer_offload_values(spec.workload.mode)
        self.param_values = s.param_offload_values(spec.workload.mode)
        train = spec.workload.mode == "train"
        self.backends: list[str] = list(s.backend)
        # each backend's knobs and the values the spec sweeps (sltune.tuning.spec.Search.backend_values)
        self.backend_values = {b: s.backend_values(b) for b in self.backends}
        found: set[Candidate] = set()
        if "speedloader" in self.backends:
            places = [(o, p) for o in self.offload_values for p in self.param_values
                      if not param_offload_refusal(p, o, train)]   # the weights on disk train beside the optimizer's
            found = {Candidate(b, n, k, a, kv, w, o, p) for b, n in pairs for k in self.k_values
                     for a in self.activation_values for kv in self.kv_values or [None]
                     for w in self.weight_shares or [None] for o, p in places}
        for backend in (b for b in self.backends if b != "speedloader"):
            found |= {Candidate(b, n, None, a, backend=backend, **v) for b, n in pairs
                      for a in self.activation_values for v in s.backend_variants(backend)}
        self.candidates = sorted(found)
        self._members = frozenset(self.candidates)

    def __contains__(self, c: object) -> bool:
        return c in self._members

    def of_backend(self, backend: str) -> list[Candidate]:
        return [c for c in self.candidates if c.backend == backend]

    # -- Optuna ------------------------------------------------------------------------------------
    @property
    def param_names(self) -> tuple[str, ...]:
        """Every parameter a trial of this space may have (each backend's, sweeping several)."""
        return tuple(self.distributions())

    def distributions(self, backend: str | None = None) -> dict[str, optuna.distributions.BaseDistribution]:
        """The parameters of a trial of `backend`, in the order they are suggested (None: every backend's, the
        union): `backend` first when the space has several."""
        def categorical(values: list[Any]) -> optuna.distributions.CategoricalDistribution:
            return optuna.distributions.CategoricalDistribution(values)

        speedloader = backend in (None, "speedloader") and "speedloader" in self.backends
        out: dict[str, optuna.distributions.BaseDistribution] = {}
        if len(self.backends) > 1:
            out["backend"] = categorical(self.backends)
        out["sub_batch_size"] = categorical(self.b_values)
        if self.by_batch:
            out["effective_batch_size"] = categorical(self.batch_values)
        else:
            out["num_sub_batches"] = categorical(self.n_values)
        if speedloader:
            out["num_live_blocks"] = categorical(self.k_values)
        if len(self.activation_values) > 1:
            out["activations"] = categorical(self.activation_values)
        if speedloader and self.kv_values:
            out["kv_cache"] = categorical(self.kv_values)
        if speedloader and self.weight_shares:
            out["weights_on_device"] = categorical(self.weight_shares)
        if speedloader and len(self.offload_values) > 1:
            out["optimizer_offload"] = categorical(self.offload_values)
        if speedloader and len(self.param_values) > 1:
            out["param_offload"] = categorical(self.param_values)
        for name in self.backends:
            if name != "speedloader" and backend in (None, name):
                out.update({knob: categorical(values) for knob, values in self.backend_values[name].items()
                            if len(values) > 1})
        return out

    def grid(self) -> dict[str, list[Any]]:
        return {name: list(d.choices) for name, d in self.distributions().items()}

    def suggest(self, trial: optuna.Trial) -> Candidate | None:
        """The trial's candidate, its parameters suggested define-by-run: the backend first, then that backend's
        (an enqueued trial's are its fixed values); None for a combination that is no candidate. One backend's
        space suggests what study.ask(distributions()) would, in the same order."""
        backend = self.backends[0]
        if len(self.backends) > 1:
            backend = trial.suggest_categorical("backend", self.backends)
        params = {"backend": backend, **{name: trial.suggest_categorical(name, dist.choices)
                                          for name, dist in self.distributions(backend).items() if name != "backend"}}
        return self.candidate(params)

    def params(self, c: Candidate) -> dict[str, Any]:
        values = {**{f.name: getattr(c, f.name) for f in fields(c)}, "effective_batch_size": c.batch}
        return {name: values[name] for name in self.distributions(c.backend)}

    def candidate(self, params: dict[str, Any]) -> Candidate | None:
        backend = str(params.get("backend", self.backends[0]))
        b = int(params["sub_batch_size"])
        a = str(params.get("activations", self.activation_values[0]))
        if self.by_batch:
            batch = int(params["effective_batch_size"])
            if batch % b:
                return None
            n = batch // b
        else:
            n = int(params["num_sub_batches"])
        if backend != "speedloader":
            own = {knob: params.get(knob, values[0]) for knob, values in self.backend_values.get(backend, {}).items()}
            c = Candidate(b, n, None, a, backend=backend, **own)
            return c if c in self else None
        k = int(params["num_live_blocks"])
        kv = params.get("kv_cache") if self.kv_values else None
        w = params.get("weights_on_device") if self.weight_shares else None
        o = str(params.get("optimizer_offload", self.offload_values[0]))
        p = str(params.get("param_offload", self.param_values[0]))
        c = Candidate(b, n, k, a, kv, w, o, p)
        return c if c in self else None

    def neighbours_up(self, c: Candidate) -> list[Candidate]:
        """Candidates one step up along one of the knobs as the spec names them (b, N or B, k; host KV -> device;
        the next larger share of the weights kept on the device; the optimizer, or the weights, from disk into host
        memory, where that is a candidate). A wrapped
        backend's knobs are not steps up: their memory and speed trade against each other, as activations' do."""
        params = self.params(c)
        out = []
        for name, dist in self.distributions(c.backend).items():
            if name in ("activations", "backend") or name in ALL_KNOBS:
                # not an order of memory: recompute and offload trade device for host, and so do a backend's knobs
                continue
            rank = {"kv_cache": KV_ORDER.index, "optimizer_offload": OFFLOAD_ORDER.index,
                    "param_offload": OFFLOAD_ORDER.index}.get(name, lambda v: v)
            larger = [v for v in dist.choices if rank(v) > rank(params[name])]
            if larger:
                other = self.candidate({**params, name: min(larger, key=rank)})
                if other is not None:
                    out.append(other)
        return out

    def describe(self) -> dict[str, Any]:
        """What best.yaml records so `sltune plan` can rebuild the space (as search.* fields: num_live_blocks only
        with speedloader, the backends and their sections when there are others)."""
        out: dict[str, Any] = {"sub_batch_size": self.b_values, "num_live_blocks": self.k_values,
                               "activations": self.activation_values}
        if "speedloader" not in self.backends:
            del out["num_live_blocks"]
        if self.by_batch:
            out["effective_batch_size"] = self.batch_values
        else:
            out["num_sub_batches"] = self.n_values
        if self.kv_values:
            out["kv_cache"] = self.kv_values
        if self.weight_shares:
            out["weights_on_device"] = self.weight_shares
        if self.offload_values != ["host"]:
            out["optimizer_offload"] = self.offload_values
        if self.param_values != ["host"]:
            out["param_offload"] = self.param_values
        if self.backends != ["speedloader"]:
            out["backend"] = self.backends
            out.update({b: self.backend_values[b] for b in self.backends if self.backend_values[b]})
        return out
