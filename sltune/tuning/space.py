"""The configs a job may try: sub-batch size b, sub-batches N (or effective batch B = b*N), live blocks k."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna

from sltune.tuning.knobs import knob_values

if TYPE_CHECKING:
    from sltune.tuning.shape import ModelShape
    from sltune.tuning.spec import TuningSpec


@dataclass(frozen=True, order=True)
class Candidate:
    b: int
    n: int
    k: int

    @property
    def batch(self) -> int:
        return self.b * self.n

    def knobs(self) -> dict[str, int]:
        return {"sub_batch_size": self.b, "num_sub_batches": self.n, "num_live_blocks": self.k}

    def dominates(self, other: "Candidate") -> bool:
        """At least as large in sub-batch, effective batch and live blocks: needs at least as much memory."""
        return self.b >= other.b and self.batch >= other.batch and self.k >= other.k and self != other

    def __str__(self) -> str:
        return f"b={self.b} N={self.n} k={self.k}"


class SearchSpace:
    """Every valid candidate, and how Optuna names them.

    Optuna sees categorical parameters: sub_batch_size and num_live_blocks, plus num_sub_batches or
    effective_batch_size as the spec gives them (N = B/b when B is the knob). A combination that is not a
    candidate (b does not divide B) is pruned without running.
    """

    def __init__(self, spec: "TuningSpec", shape: "ModelShape"):
        s = spec.search
        self.b_values = knob_values(s.sub_batch_size, "sub_batch_size")
        self.k_values = sorted({min(k, shape.layers) for k in knob_values(s.num_live_blocks, "num_live_blocks")})
        self.by_batch = s.effective_batch_size is not None
        if self.by_batch:
            self.batch_values = knob_values(s.effective_batch_size, "effective_batch_size")
            pairs = [(b, bb // b) for b in self.b_values for bb in self.batch_values if bb % b == 0]
        else:
            self.n_values = knob_values(s.num_sub_batches, "num_sub_batches")
            pairs = [(b, n) for b in self.b_values for n in self.n_values]
        self.candidates = sorted({Candidate(b, n, k) for b, n in pairs for k in self.k_values})

    # -- Optuna ------------------------------------------------------------------------------------
    @property
    def param_names(self) -> tuple[str, str, str]:
        return ("sub_batch_size", "effective_batch_size" if self.by_batch else "num_sub_batches", "num_live_blocks")

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        second = self.batch_values if self.by_batch else self.n_values
        return {
            "sub_batch_size": optuna.distributions.CategoricalDistribution(self.b_values),
            self.param_names[1]: optuna.distributions.CategoricalDistribution(second),
            "num_live_blocks": optuna.distributions.CategoricalDistribution(self.k_values),
        }

    def grid(self) -> dict[str, list[Any]]:
        return {name: list(d.choices) for name, d in self.distributions().items()}

    def params(self, c: Candidate) -> dict[str, int]:
        second = c.batch if self.by_batch else c.n
        return {"sub_batch_size": c.b, self.param_names[1]: second, "num_live_blocks": c.k}

    def candidate(self, params: dict[str, Any]) -> Candidate | None:
        b, k = int(params["sub_batch_size"]), int(params["num_live_blocks"])
        if self.by_batch:
            batch = int(params["effective_batch_size"])
            if batch % b:
                return None
            c = Candidate(b, batch // b, k)
        else:
            c = Candidate(b, int(params["num_sub_batches"]), k)
        return c if c in set(self.candidates) else None

    def neighbours_up(self, c: Candidate) -> list[Candidate]:
        """Candidates one step up along one of the knobs as the spec names them (b, N or B, k)."""
        params = self.params(c)
        out = []
        for name, dist in self.distributions().items():
            larger = [v for v in dist.choices if v > params[name]]
            if larger:
                other = self.candidate({**params, name: min(larger)})
                if other is not None:
                    out.append(other)
        return out

    def describe(self) -> dict[str, Any]:
        """What best.yaml records so `sltune plan` can rebuild the space."""
        out = {"sub_batch_size": self.b_values, "num_live_blocks": self.k_values}
        if self.by_batch:
            out["effective_batch_size"] = self.batch_values
        else:
            out["num_sub_batches"] = self.n_values
        return out
