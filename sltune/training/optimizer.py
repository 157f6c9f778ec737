"""The optimizer section of a spec, a best.yaml and `sltune train`: what the host steps, and with what.

Trials build the same optimizer the training job will run, so the host memory and the optimizer time a
trial measures are the job's. The host step is fused (one kernel over each tensor list on the CPU, as on
CUDA): bench/optimizer.py measures it against the foreach path and DeepSpeed's CPU Adam.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sltune.field_errors import one_line, unknown_among

if TYPE_CHECKING:       # torch loads when an optimizer is built: the spec and the CLI read this model without it
    import torch

OptimizerName = Literal["adamw", "sgd"]

# bytes of optimizer state per trainable parameter, in the dtype the optimizer steps: AdamW keeps two
# moments, SGD a momentum buffer only when momentum > 0
STATE_TENSORS = {"adamw": 2, "sgd": 1}


class OptimizerConfig(BaseModel):
    """AdamW or SGD with their hyperparameters; torch's defaults where a field is left out."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: OptimizerName = Field("adamw", description="adamw | sgd")
    lr: float = Field(1e-3, gt=0, le=10, description="learning rate (the peak, under a schedule)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's moment decay rates, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, le=1, description="AdamW's denominator term")
    weight_decay: float | None = Field(None, ge=0, le=1, description="decoupled weight decay (AdamW) or L2 "
                                        "(SGD); default torch's: 0.01 for AdamW, 0 for SGD")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD's momentum")

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, source: str = "optimizer") -> "OptimizerConfig":
        """The section as a spec or best.yaml gives it; a bad field is named with the fix."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping such as {{name: adamw, lr: 1e-5}}, "
                             f"got {type(data).__name__}")
        try:
            return cls(**data)
        except ValidationError as err:
            raise ValueError(one_line(err, within=source, unknown=unknown_among(cls.model_fields))) from None

    def to_dict(self) -> dict[str, Any]:
        out = self.model_dump()
        out["betas"] = list(self.betas)
        return out

    def state_bytes_per_param(self, itemsize: int = 4) -> int:
        """Optimizer state per trainable parameter, in bytes of the dtype it steps."""
        if self.name == "sgd" and self.momentum == 0:
            return 0
        return STATE_TENSORS[self.name] * itemsize

    def build(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The torch optimizer over these parameters, fused where every parameter is a floating tensor on
        one device (the CPU kernel steps each list in one call); foreach otherwise."""
        import torch

        params = list(params)
        devices = {p.device for p in params}
        fused = len(devices) <= 1 and all(p.is_floating_point() for p in params)
        kind = {"fused": True} if fused else {"foreach": True}
        if self.name == "adamw":
            decay = 0.01 if self.weight_decay is None else self.weight_decay
            return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=decay, **kind)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay or 0.0,
                               **kind)

    # the engine takes a factory: OptimizerConfig(...).factory is one
    def factory(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return self.build(params)
