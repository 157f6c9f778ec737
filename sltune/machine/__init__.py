"""This machine's rates, measured once: what a step costs here, op by op and byte by byte.

`calibrate` times the work a training step is made of (matmuls at a model's own shapes and dtype, attention,
the elementwise and norm work per token, the optimizer's step per element, host-device copies, disk reads and
writes through the engine's own O_DIRECT files, and the fixed cost of an op), each a median with its spread.
`MachineRates` is what it returns and what `sltune calibrate` stores per machine (`Fingerprint`) and writes as
JSON.
"""

from typing import TYPE_CHECKING

from sltune.lazy import exports

if TYPE_CHECKING:
    from sltune.machine.probes import calibrate
    from sltune.machine.fingerprint import Fingerprint
    from sltune.machine.rates import AttentionRate, MachineRates, MatmulRate, Rate
    from sltune.machine.workload import Workload

__all__ = ["AttentionRate", "Fingerprint", "MachineRates", "MatmulRate", "Rate", "Workload", "calibrate"]
# the rates load without torch (a plan reads them from a file); calibrating loads it
__getattr__ = exports(__name__, {"Workload": "sltune.machine.workload", "calibrate": "sltune.machine.probes",
                                 "Fingerprint": "sltune.machine.fingerprint", "AttentionRate": "sltune.machine.rates",
                                 "MachineRates": "sltune.machine.rates", "MatmulRate": "sltune.machine.rates",
                                 "Rate": "sltune.machine.rates"})
