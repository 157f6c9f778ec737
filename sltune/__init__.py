"""sltune: the SpeedLoader runtime for LLMs larger than device memory, with profiling and tuning.

    from sltune import SpeedLoaderConfig, SpeedLoaderEngine
"""

from sltune.config import SpeedLoaderConfig
from sltune.runtime.engine import SpeedLoaderEngine, StepResult
from sltune.runtime.memory import DeviceMemoryExceeded
from sltune.runtime.transfer import IOCounters

__version__ = "0.1.0"

__all__ = ["SpeedLoaderConfig", "SpeedLoaderEngine", "StepResult", "DeviceMemoryExceeded", "IOCounters",
           "__version__"]
