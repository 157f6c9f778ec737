"""Checking a POST /tune body without ever blocking the API's event loop.

A spec is checked against the model's shape, which transformers builds on the meta device: seconds of
pure Python for a big config, which in the event loop (or a thread, holding the GIL) stalls every other
request. So the check runs in a small pool of processes of their own, each task with a deadline past
which its process is killed, and the verdicts are cached, since CI posts the same spec again and again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import OrderedDict
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from pebble import ProcessExpired, ProcessPool
from pydantic import ValidationError

from sltune.profiling import forks
from sltune.service.ceilings import Refused, admit
from sltune.settings import Settings

Errors = list[tuple[str, str]]      # (field path, one-line message naming the fix)


@dataclass(frozen=True)
class Verdict:
    job: dict[str, Any] | None = None        # Store.create_job's arguments: the spec as the server runs it
    errors: Errors | None = None


class Busy(RuntimeError):
    """More specs are waiting to be checked than the server queues: retry later."""


def check(data: Any, settings: Settings) -> Verdict:
    """The whole admission check of one spec (validation, then the ceilings); runs in a pool process."""
    from sltune.tuning.runner import requirements
    from sltune.tuning.spec import TuningSpec, field_errors

    if not isinstance(data, dict):
        return Verdict(errors=[("", "expected a JSON object with model, workload, hardware and search")])
    try:
        spec, limits = admit(TuningSpec.model_validate(data), settings)
    except ValidationError as err:
        return Verdict(errors=field_errors(err))
    except Refused as err:
        return Verdict(errors=err.errors)
    return Verdict(job={"name": spec.name, "spec": spec.model_dump(mode="json"), "spec_hash": spec.digest(),
                        "requirements": requirements(spec), "limits": limits})


def _start_worker() -> None:
    from sltune.profiling.lifeline import die_with_parent

    die_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C in `sltune serve` is the server's to handle
    os.nice(10)           # a heavy check yields the CPU to the server answering requests meanwhile


class SpecChecker:
    """A pool of checker processes, a deadline per check, a cache of verdicts, a bounded queue."""

    def __init__(self, settings: Settings, cache_size: int = 512):
        self.settings = settings
        self.cache: OrderedDict[str, Verdict] = OrderedDict()
        self.cache_size = cache_size
        self.pending = 0
        self.pool = ProcessPool(max_workers=settings.spec_check_workers, initializer=_start_worker,
                                context=forks.context())

    async def check(self, data: Any) -> Verdict:
        if not isinstance(data, dict):         # no need to queue behind heavy specs for this one
            return check(data, self.settings)
        key = json.dumps(data, sort_keys=True, separators=(",", ":"))
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        if self.pending >= self.settings.spec_check_queue:
            raise Busy(f"{self.pending} specs are being checked; retry in a few seconds")
        self.pending += 1
        timeout = self.settings.spec_check_timeout_s
        try:
            verdict = await asyncio.wrap_future(self.pool.schedule(check, (data, self.settings), timeout=timeout))
        except FutureTimeout:
            verdict = Verdict(errors=[("model", f"checking this spec took over {timeout:g}s (building the "
                                                "model's shape); use a smaller model")])
        except ProcessExpired as err:     # not cached: the machine may have been short of memory just now
            return Verdict(errors=[("model", f"the process checking this spec died ({err}); use a smaller "
                                             "model, or retry")])
        finally:
            self.pending -= 1
        self.cache[key] = verdict
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return verdict

    async def warm_up(self) -> None:
        """Start the pool's fork server and processes (importing torch and transformers: seconds) before
        the first request, not during it."""
        futures = [self.pool.schedule(check, ({"model": {"preset": "llama-tiny"}}, self.settings))
                   for _ in range(self.settings.spec_check_workers)]
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

    def close(self) -> None:
        self.pool.stop()
        self.pool.join(timeout=10)
