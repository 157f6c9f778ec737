"""The configs a job may try: sub-batch size b, sub-batches N (or effective batch B = b*N), live blocks k, how
a group's backward gets its activations (recompute or offload), in training where the optimizer's master and
state live (host memory or files on disk), and for generation where the KV caches live and the share of the
weights kept on the device (w)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna

from sltune.tuning.knobs import knob_values

if TYPE_CHECKING:
    from sltune.tuning.cost.shape import ModelShape
    from sltune.tuning.spec import TuningSpec


KV_ORDER = ("host", "device")     # device KV needs more device memory, and moves nothing
OFFLOAD_ORDER = ("disk", "host")  # host holds the master and optimizer state in memory: more host, no disk traffic


@dataclass(frozen=True, order=True)
class Candidate:
    b: int
    n: int
    k: int
    activations: str = "recompute"
    kv_cache: str | None = None     # generation only: "host" | "device"
    weights_on_device: float | None = None  # generation only: the share of the weights kept there
    optimizer_offload: str = "host"  # training: the master and optimizer state in host memory, or in files ("disk")

    @classmethod
    def from_knobs(cls, knobs: dict[str, Any]) -> "Candidate":
        return cls(knobs["sub_batch_size"], knobs["num_sub_batches"], knobs["num_live_blocks"],
                   knobs.get("activations", "recompute"), knobs.get("kv_cache"), knobs.get("weights_on_device"),
                   knobs.get("optimizer_offload") or "host")

    @property
    def batch(self) -> int:
        return self.b * self.n

    @property
    def kv_on_device(self) -> bool:
        return self.kv_cache == "device"

    def knobs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sub_batch_size": self.b, "num_sub_batches": self.n, "num_live_blocks": self.k,
                               "activations": self.activations}
        if self.kv_cache is not None:
            out["kv_cache"] = self.kv_cache
        if self.weights_on_device is not None:
            out["weights_on_device"] = self.weights_on_device
        if self.optimizer_offload != "host":     # trials and configs from before the knob are host's
            out["optimizer_offload"] = self.optimizer_offload
        return out

    @property
    def on_disk(self) -> bool:
        return self.optimizer_offload == "disk"

    def dominates(self, other: "Candidate") -> bool:
        """At least as large in sub-batch, effective batch and live blocks, activations kept alike, KV on the
        device if the other's is, at least its share of the weights kept there, the optimizer in host memory if the
        other's is: needs at least as much device memory (and, moving less, runs no slower; disk's reads and
        writes come on top of the same step)."""
        return self.b >= other.b and self.batch >= other.batch and self.k >= other.k \
            and self.activations == other.activations and self.kv_on_device >= other.kv_on_device \
            and (self.weights_on_device or 0.0) >= (other.weights_on_device or 0.0) \
            and self.on_disk <= other.on_disk and self != other

    def __str__(self) -> str:
        return (f"b={self.b} N={self.n} k={self.k}" + ("" if self.activations == "recompute" else f" {self.activations}")
                + (f" kv_cache={self.kv_cache}" if self.kv_cache else "")
                + (f" w={self.weights_on_device:g}" if self.weights_on_device is not None else "")
                + (f" optimizer_offload={self.optimizer_offload}" if self.optimizer_offload != "host" else ""))


class SearchSpace:
    """Every valid candidate, and how Optuna names them.

    Optuna sees categorical parameters: sub_batch_size and num_live_blocks, plus num_sub_batches or
    effective_batch_size as the spec gives them (N = B/b when B is the knob), activations when the spec sweeps
    it, optimizer_offload when the spec sweeps it (training), and kv_cache and weights_on_device for generation.
    A combination that is not a candidate (b does not divide
    B) is pruned without running.
    """

    def __init__(self, spec: "TuningSpec", shape: "ModelShape"):
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
        self.candidates = sorted({Candidate(b, n, k, a, kv, w, o) for b, n in pairs for k in self.k_values
                                  for a in self.activation_values for kv in self.kv_values or [None]
                                  for w in self.weight_shares or [None] for o in self.offload_values})
        self._members = frozenset(self.candidates)

    def __contains__(self, c: object) -> bool:
        return c in self._members

    # -- Optuna ------------------------------------------------------------------------------------
    @property
    def param_names(self) -> tuple[str, ...]:
        names = ("sub_batch_size", "effective_batch_size" if self.by_batch else "num_sub_batches", "num_live_blocks")
        return (names + (("activations",) if len(self.activation_values) > 1 else ())
                + (("kv_cache",) if self.kv_values else ()) + (("weights_on_device",) if self.weight_shares else ())
                + (("optimizer_offload",) if len(self.offload_values) > 1 else ()))

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        second = self.batch_values if self.by_batch else self.n_values
        out = {
            "sub_batch_size": optuna.distributions.CategoricalDistribution(self.b_values),
            self.param_names[1]: optuna.distributions.CategoricalDistribution(second),
            "num_live_blocks": optuna.distributions.CategoricalDistribution(self.k_values),
        }
        if len(self.activation_values) > 1:
            out["activations"] = optuna.distributions.CategoricalDistribution(self.activation_values)
        if self.kv_values:
            out["kv_cache"] = optuna.distributions.CategoricalDistribution(self.kv_values)
        if self.weight_shares:
            out["weights_on_device"] = optuna.distributions.CategoricalDistribution(self.weight_shares)
        if len(self.offload_values) > 1:
            out["optimizer_offload"] = optuna.distributions.CategoricalDistribution(self.offload_values)
        return out

    def grid(self) -> dict[str, list[Any]]:
        return {name: list(d.choices) for name, d in self.distributions().items()}

    def params(self, c: Candidate) -> dict[str, Any]:
        second = c.batch if self.by_batch else c.n
        out: dict[str, Any] = {"sub_batch_size": c.b, self.param_names[1]: second, "num_live_blocks": c.k}
        if len(self.activation_values) > 1:
            out["activations"] = c.activations
        if self.kv_values:
            out["kv_cache"] = c.kv_cache
        if self.weight_shares:
            out["weights_on_device"] = c.weights_on_device
        if len(self.offload_values) > 1:
            out["optimizer_offload"] = c.optimizer_offload
        return out

    def candidate(self, params: dict[str, Any]) -> Candidate | None:
        b, k = int(params["sub_batch_size"]), int(params["num_live_blocks"])
        a = str(params.get("activations", self.activation_values[0]))
        kv = params.get("kv_cache") if self.kv_values else None
        w = params.get("weights_on_device") if self.weight_shares else None
        o = str(params.get("optimizer_offload", self.offload_values[0]))
        if self.by_batch:
            batch = int(params["effective_batch_size"])
            if batch % b:
                return None
            c = Candidate(b, batch // b, k, a, kv, w, o)
        else:
            c = Candidate(b, int(params["num_sub_batches"]), k, a, kv, w, o)
        return c if c in self else None

    def neighbours_up(self, c: Candidate) -> list[Candidate]:
        """Candidates one step up along one of the knobs as the spec names them (b, N or B, k; host KV -> device;
        the next larger share of the weights kept on the device; the optimizer from disk into host memory)."""
        params = self.params(c)
        out = []
        for name, dist in self.distributions().items():
            if name == "activations":       # not an order of memory: recompute and offload trade device for host
                continue
            rank = {"kv_cache": KV_ORDER.index, "optimizer_offload": OFFLOAD_ORDER.index}.get(name, lambda v: v)
            larger = [v for v in dist.choices if rank(v) > rank(params[name])]
            if larger:
                other = self.candidate({**params, name: min(larger, key=rank)})
                if other is not None:
                    out.append(other)
        return out

    def describe(self) -> dict[str, Any]:
        """What best.yaml records so `sltune plan` can rebuild the space."""
        out: dict[str, Any] = {"sub_batch_size": self.b_values, "num_live_blocks": self.k_values,
                               "activations": self.activation_values}
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
        return out
