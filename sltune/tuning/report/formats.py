"""A finished job's pick in the format asked: best.yaml (any backend's pick), DeepSpeed's JSON config (a deepspeed
pick), accelerate's FSDP2 config YAML (an fsdp pick). `sltune export` and GET /jobs/{id}/config.yaml answer with it;
the formats themselves are sltune.backends.export's."""

from __future__ import annotations

from typing import Any

from sltune.backends.export import (MEDIA_TYPES, accelerate_config, accelerate_yaml, backend_of, check_format,
                                    deepspeed_config, deepspeed_json, model_facts, pick, picked)
from sltune.tuning.report.result import export_yaml
from sltune.tuning.spec import TuningSpec


def export_config(spec: TuningSpec, result: dict[str, Any], backend: str | None = None, fmt: str = "yaml",
                  flags: tuple[str, str] = ("--backend", "--format")) -> tuple[str, str]:
    """(text, media type) of the overall best, or of `backend`'s pick, in `fmt`. `flags` name the backend and the
    format in a refusal: the CLI's flags, or the API's query parameters."""
    entry = pick(result, backend, flags[0])
    check_format(fmt, backend_of(entry), flags, picked(result))
    if fmt == "yaml":
        return export_yaml(spec, result, backend=backend), MEDIA_TYPES[fmt]
    facts = model_facts(spec.model.source)
    knobs = entry["config"]
    if fmt == "ds_config":
        config = deepspeed_config(knobs, dtype=spec.model.dtype, optimizer=spec.optimizer.to_dict(),
                                  hidden_size=facts.hidden_size)
        return deepspeed_json(config), MEDIA_TYPES[fmt]
    config = accelerate_config(knobs, dtype=spec.model.dtype, world_size=spec.hardware.world_size,
                               layer_classes=facts.layer_classes)
    return accelerate_yaml(config, knobs, spec.hardware.device), MEDIA_TYPES[fmt]
