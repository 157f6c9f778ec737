"""sltune: the SpeedLoader runtime for LLMs larger than device memory, with profiling and tuning.

    from sltune import SpeedLoaderConfig, SpeedLoaderEngine
"""

import os

# OpenMP threads spin while they wait for each other by default. With more runnable threads than cores
# (a shared machine, or trials beside a server) every small parallel op then waits for a descheduled
# partner: one decode step's per-sub-batch matmuls ran 10-90x slower (docs/concepts/measurement.md, "Threads").
# Threads that sleep while idle do not fight. libgomp reads this when torch loads, so it only takes effect if torch is
# not imported yet; an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from typing import TYPE_CHECKING  # noqa: E402

from sltune.lazy import exports  # noqa: E402

if TYPE_CHECKING:
    from sltune.config import SpeedLoaderConfig
    from sltune.runtime.engine import SpeedLoaderEngine, StepResult
    from sltune.runtime.counters import IOCounters
    from sltune.runtime.memory import DeviceMemoryExceeded

__getattr__ = exports(__name__, {"SpeedLoaderConfig": "sltune.config", "SpeedLoaderEngine": "sltune.runtime.engine",
                                 "StepResult": "sltune.runtime.engine", "DeviceMemoryExceeded": "sltune.runtime.memory",
                                 "IOCounters": "sltune.runtime.counters"})

__version__ = "0.1.0"

__all__ = ["SpeedLoaderConfig", "SpeedLoaderEngine", "StepResult", "DeviceMemoryExceeded", "IOCounters",
           "__version__"]

