"""The machine rates a job, a plan and calibrate share: the newest this machine stored for a spec's shapes
(`sltune calibrate SPEC`), while they are fresh."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from sltune.machine.fingerprint import Fingerprint
from sltune.machine.rates import MachineRates
from sltune.tuning.cost.workload import workload_of

if TYPE_CHECKING:
    from sltune.tuning.spec import TuningSpec

STALE_AFTER = timedelta(days=30)     # a driver, BIOS or kernel update moves rates without changing the fingerprint


def rates_key(spec_workload_key: str, how: str) -> str:
    """The store's key of rates measured for a workload: its own key first (so that a spec's shapes find them by
    prefix, stored_rates), then a digest of how they were measured."""
    return f"{spec_workload_key}-{how}"


def stored_rates(store: Any, spec: "TuningSpec") -> MachineRates | None:
    """The newest rates this machine stored for the spec's shapes on the spec's kind of device, while fresh; None
    when there are none."""
    row = store.latest_rates(Fingerprint.here().key, rates_key(workload_of(spec).key, ""), prefix=True)
    if row is None:
        return None
    rates = MachineRates.model_validate(row.rates)
    if rates.device.split(":")[0] != spec.hardware.device.split(":")[0]:
        return None
    return rates if fresh(rates) else None


def fresh(rates: MachineRates) -> bool:
    return datetime.now(timezone.utc) - rates.measured_at < STALE_AFTER
