"""Training backends a trial can run, chosen by name: SpeedLoader's engine, DeepSpeed ZeRO, PyTorch FSDP2.

    backend = build("deepspeed", TrainingSpec.of(trial_spec))     # sltune.backends.base.TrainingSpec
    result = backend.step(ids)              # one optimizer step on b*N rows: loss, tokens, seconds, device peak
    backend.close()

Each lives in a module of its own, imported only when chosen (DeepSpeed is an optional extra:
`bash scripts/install.sh backends`). This package loads without torch; the backends' names and knobs are sltune.backend_knobs'.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from sltune.backend_knobs import BACKENDS

if TYPE_CHECKING:
    from sltune.backends.base import Backend, TrainingSpec

__all__ = ["BACKENDS", "build"]


def build(name: str, spec: TrainingSpec) -> Backend:
    """The backend called `name`, built for `spec` (a multi-rank trial's process group already joined)."""
    if name == "speedloader":
        from sltune.backends import speedloader as module
    elif name == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:    # not imported here: its accelerator is chosen first
            from sltune.backends.deepspeed_ops import INSTALL

            raise ImportError(f"backend deepspeed: DeepSpeed is not installed; install it with `{INSTALL}`")
        from sltune.backends import deepspeed as module
    elif name == "fsdp":
        from sltune.backends import fsdp as module
    else:
        raise ValueError(f"backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return module.build(spec)
