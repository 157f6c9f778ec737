"""Each backend's name and knobs, and the one-line refusals of a knob that does not fit (light: no torch).

Defined in sltune.backend_knobs, below sltune.config (which validates a best.yaml's backend with them, and which the
backends' runtime imports: defined here, config and backends would import each other); the backends and the specs
read them from here.
"""

from sltune.backend_knobs import (ALL_KNOBS, BACKEND_KNOB, BACKENDS, DEFAULTS, KNOBS, BackendChoice, BackendKnob,
                                  BackendKnobs, BackendName, CheckedBackendKnobs, Knob, OffloadTarget, ZeroStage,
                                  knobs_of, libaio_found, owner, refusals, speedloader_only)

__all__ = ["ALL_KNOBS", "BACKEND_KNOB", "BACKENDS", "DEFAULTS", "KNOBS", "BackendChoice", "BackendKnob", "BackendKnobs",
           "BackendName", "CheckedBackendKnobs", "Knob", "OffloadTarget", "ZeroStage", "knobs_of", "libaio_found",
           "owner", "refusals", "speedloader_only"]
