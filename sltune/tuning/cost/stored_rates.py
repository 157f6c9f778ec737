"""The machine rates a job, a plan and calibrate share: the newest this machine stored for a spec's shapes
(`sltune calibrate SPEC`), while they are fresh; measured and stored where they are not."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

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


def calibrated(store: Any, spec: "TuningSpec | None", folder: Path, *, budget_s: float = 60.0,
               ranks: list[int] | None = None, again: bool = False,
               progress: Callable[[str], None] = lambda _: None) -> tuple[MachineRates, bool]:
    """This machine's rates for the spec's shapes, dtype, device and optimizers (without a spec llama-small's in
    float32 on the CPU), and whether they were measured now: the store's while fresh (unless `again`), else measured
    in about `budget_s` seconds, the disk in `folder`, and stored. `ranks`: the collectives' rank counts (default: the
    spec's hardware.world_size when above 1)."""
    import torch

    from sltune.backends.deepspeed import deepspeed_adam
    from sltune.machine import Workload, calibrate
    from sltune.training.optimizer import OptimizerConfig

    workload, device, threads, host_optimizer, deepspeed = Workload(), "cpu", None, OptimizerConfig(), False
    if spec is not None:
        workload, device, threads = workload_of(spec), spec.hardware.device, spec.hardware.cpu_threads
        host_optimizer, deepspeed = spec.optimizer, "deepspeed" in spec.search.backend
    ranks = collective_ranks(spec, ranks)
    optimizers = {f"torch.{host_optimizer.name}": host_optimizer.build,         # the runtime's host step
                  **(deepspeed_adam(device, progress) if deepspeed else {})}
    before = torch.get_num_threads()
    if threads:         # as the spec's trials run; given back after, for a worker's next job runs in this process
        torch.set_num_threads(threads)
    try:
        machine = Fingerprint.here()
        # what decides the rates besides the machine: the same key, the same measurement; the workload's own key
        # first, so that a plan finds the rates of its shapes (stored_rates)
        how = json.dumps([device, torch.get_num_threads(), str(folder), sorted(optimizers),
                          host_optimizer.model_dump(mode="json"), ranks])
        key = rates_key(workload.key, hashlib.sha256(how.encode()).hexdigest()[:16])
        row = None if again else store.latest_rates(machine.key, key)
        stored = None if row is None else MachineRates.model_validate(row.rates)
        if stored is not None and fresh(stored):
            return stored, False
        from sltune.profiling import forks

        rates = calibrate(workload, device, budget_s, folder, progress=progress, optimizers=optimizers,
                          world_sizes=tuple(ranks), processes=forks.context() if ranks else None)
        store.save_rates(machine.key, key, rates.model_dump(mode="json"))
        return rates, True
    finally:
        torch.set_num_threads(before)


def collective_ranks(spec: "TuningSpec | None", asked: list[int] | None = None) -> list[int]:
    """The rank counts calibrate times the collectives over: those asked, else the spec's hardware.world_size when
    above 1, else none."""
    if not asked and spec is not None and spec.hardware.world_size > 1:
        asked = [spec.hardware.world_size]
    return sorted(set(asked or []))
