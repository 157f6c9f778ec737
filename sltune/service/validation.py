"""Checking a POST /tune body without ever blocking the API's event loop.

A spec is checked against the model's shape, which transformers builds on the meta device: seconds of
pure Python for a big config, which in the event loop (or a thread, holding the GIL) stalls every other
request. So the check runs in a small pool of processes of their own, each task with a deadline past
which its process is killed, and the verdicts are cached, since CI posts the same spec again and again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
from collections import OrderedDict
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pebble import ProcessExpired, ProcessPool
from pydantic import ValidationError

from sltune.field_errors import field_errors
from sltune.models import confined
from sltune.plaindata import problems
from sltune.profiling import forks
from sltune.service.ceilings import Refused, within_ceilings
from sltune.settings import Settings

Errors = list[tuple[str, str]]      # (field path, one-line message naming the fix)
NAME_MAX, PATH_MAX = 255, 4096      # Linux's bytes in a file name, and in a path with its final NUL


@dataclass(frozen=True)
class Verdict:
    job: dict[str, Any] | None = None        # Store.create_job's arguments: the spec as the server runs it
    errors: Errors | None = None
    cacheable: bool = True                   # a verdict on a model folder holds only as long as the folder does


class Busy(RuntimeError):
    """More specs are waiting to be checked than the server queues: retry later."""


def parse(body: bytes) -> tuple[Any, Errors | None]:
    """A POST /tune body as data, or why it is not a spec's: not JSON (NaN and Infinity, which Python's parser
    would take, included), nested past any spec, or holding what could never be stored and read back (a lone
    surrogate, a number beyond a double's range: see sltune.plaindata)."""
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number; give a finite number")

    try:
        data = json.loads(body, parse_constant=no_constants)
    except RecursionError:
        return None, [("", "the body is nested deeper than a spec can be (about 1,000 levels); a spec needs a "
                           "few: flatten it")]
    except ValueError as err:       # JSONDecodeError and UnicodeDecodeError are ValueErrors too
        return None, [("", f"the body is not valid JSON: {err}")]
    return data, problems(data) or None


def check_body(body: bytes, settings: Settings) -> Verdict:
    """POST /tune's whole check, from the raw bytes: parsed here, in a pool process, so that neither a big body
    nor a storm of them holds the server's event loop."""
    data, errors = parse(body)
    return Verdict(errors=errors) if errors else check(data, settings)


def check(data: Any, settings: Settings) -> Verdict:
    """The whole admission check of one spec (validation, then the ceilings); runs in a pool process."""
    if not isinstance(data, dict):
        return Verdict(errors=[("", "expected a JSON object with model, workload, hardware and search")])
    if isinstance(data.get("model"), dict) and data["model"].get("path") is not None:
        return _uncached(_check(data, settings))
    return _check(data, settings)


def _uncached(verdict: Verdict) -> Verdict:
    return Verdict(job=verdict.job, errors=verdict.errors, cacheable=False)


def _check(data: dict[str, Any], settings: Settings) -> Verdict:
    from sltune.tuning.cost import admission
    from sltune.tuning.runner import requirements
    from sltune.tuning.spec import UNKNOWN_SPEC_FIELD, TuningSpec

    try:
        data, confinement = inside_models_dir(data, settings)
        before_validation(data, settings)
    except Refused as err:
        return Verdict(errors=err.errors)
    try:
        with confined.within(confinement and confinement["models_dir"]):   # the folder as it is read, not as it was
            spec = TuningSpec.model_validate(data)
            ok = admission.admit(spec)          # its model's shape against its limits, then the server's ceilings
            spec, limits = within_ceilings(ok, settings)
    except ValidationError as err:
        return Verdict(errors=field_errors(err, unknown=UNKNOWN_SPEC_FIELD))
    except Refused as err:
        return Verdict(errors=err.errors)
    except confined.OutsideModelsDir as err:
        return Verdict(errors=[("model.path", str(err))])
    except ValueError as err:
        return Verdict(errors=[("", str(err))])
    except OSError as err:
        if confinement is None:
            raise
        return Verdict(errors=[("model.path", f"the folder cannot be read ({err.strerror or type(err).__name__}); "
                                              "give a Hugging Face model folder inside models_dir")])
    if confinement is not None:
        limits[confined.LIMIT] = confinement
    return Verdict(job={"name": spec.name, "spec": spec.model_dump(mode="json"), "spec_hash": spec.digest(),
                        "requirements": requirements(spec), "limits": limits})


def before_validation(data: dict[str, Any], settings: Settings) -> None:
    """The ceilings a spec's own validation would take long to get past, checked on the raw data first: the ranks
    (hardware.world_size; the predictions' cost grows with them: 524,289 held the checker for 20 s). Refused
    above this server's; what is no number at all is the spec's validation to say."""
    hardware = data.get("hardware")
    ranks = hardware.get("world_size") if isinstance(hardware, dict) else None
    ceiling = settings.world_size_ceiling
    if isinstance(ranks, (int, float)) and not isinstance(ranks, bool) and ranks > ceiling:
        raise Refused([("hardware.world_size", f"{ranks:g} is above this server's limit of {ceiling} (a trial runs "
                                               f"its ranks on one machine: SLTUNE_MAX_WORLD_SIZE, by default the "
                                               f"server's cores); ask for at most {ceiling}")])


def inside_models_dir(data: dict[str, Any], settings: Settings) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A spec naming model.path, with the path made absolute inside the server's models_dir (a relative path
    is read from there), and the job's record of that confinement (sltune.models.confined.admission: every later
    read of the folder is checked against it); Refused when the server has no models_dir, the path could be no
    path (_unusable), or the folder lies outside it, symlinks and '..' resolved, or so does any file a job reads
    from it (files_inside). Runs before anything reads the path: a server reads no folder a request names anywhere
    else, nor any file such a folder leads to. Other specs come back as they are, with no record."""
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("path"), str) or not model["path"]:
        return data, None    # no path, or not a string: the spec's own validation says what is wrong
    if settings.models_dir is None:
        raise Refused([("model.path", "this server has no models_dir, so it reads no model folder a request "
                                      "names; give model.preset or model.hf_config, or ask its operator to set "
                                      "SLTUNE_MODELS_DIR (sltune serve --models-dir)")])
    root = Path(settings.models_dir).expanduser().resolve()
    unusable = _unusable(root, model["path"])
    if unusable:
        raise Refused([("model.path", f"{unusable}; give the model folder's path inside models_dir (relative to it, "
                                      "or absolute)")])
    try:
        folder = (root / model["path"]).resolve()          # an absolute path stays itself
        inside = folder.is_relative_to(root)
    except (OSError, ValueError, RuntimeError):             # undecodable, a symlink loop: not a folder
        inside = False
    if not inside:
        raise Refused([("model.path", "the folder is outside this server's models_dir; give a path inside "
                                      "models_dir (relative to it, or absolute), with no symlink or '..' "
                                      "leading out of it")])
    with confined.within(root):      # the index files_inside reads, as it is read
        files_inside(folder, root)
    return {**data, "model": {**model, "path": str(folder)}}, confined.admission(model["path"], folder, root)


def _unusable(root: Path, path: str) -> str | None:
    """Why no file system here could hold `path` inside `root`: a NUL byte, a name longer than NAME_MAX bytes, or
    the whole longer than PATH_MAX (Linux's limits; the lookup would fail with ENAMETOOLONG, a 500 once). Counted,
    not looked up: nothing touches such a path."""
    if "\x00" in path:
        return "it holds a NUL byte, which no path can"
    size = len(os.fsencode(path))
    longest = max(len(os.fsencode(part)) for part in path.split("/"))
    whole = size if os.path.isabs(path) else len(os.fsencode(str(root))) + 1 + size
    if longest > NAME_MAX:
        return f"a name in it is {longest} bytes long, more than the {NAME_MAX} a file name may have"
    if whole >= PATH_MAX:
        return f"it is {whole} bytes long inside models_dir, more than the {PATH_MAX - 1} a path may have"
    return None


def files_inside(folder: Path, root: Path) -> None:
    """Refused (model.path, naming the file by its role, never a path) when a file a job would read from the
    folder leads outside models_dir, symlinks resolved: config.json, the index and every shard it lists, or
    model.safetensors. Whether the file exists is not asked first, so the answer tells nothing of what lies
    outside. An index that is not one (or names a file through '..' or by an absolute path) is the spec's own
    validation to refuse (sltune.models.checkpoint.read_index, which opens no shard)."""
    from sltune.models.checkpoint import INDEX, WEIGHTS, read_index

    def leads_out(path: Path) -> bool:
        try:
            return not path.resolve().is_relative_to(root)
        except (OSError, ValueError, RuntimeError):         # a symlink loop, ...: not a file a job can read
            return True

    def refuse(what: str) -> None:
        raise Refused([("model.path", f"the folder's {what} leads outside this server's models_dir (a symlink); "
                                      "the server reads no file outside it: copy the file into the folder")])

    for name in ("config.json", INDEX):
        if leads_out(folder / name):
            refuse(name)
    if _is_file(folder / INDEX):
        try:
            shards = set(read_index(folder).values())
        except (ValueError, OSError):       # the spec's own validation says what is wrong with it
            return
        if any(leads_out(shard) for shard in shards):
            refuse(f"{INDEX} lists a shard that")
    elif leads_out(folder / WEIGHTS):
        refuse(WEIGHTS)


def _is_file(path: Path) -> bool:
    """Path.is_file, with any error looking it up (a name too long once the folder's symlinks are resolved, a
    folder this process may not enter) a no: what the spec's own validation then says of the folder."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


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
        self.pool = ProcessPool(max_workers=settings.spec_checkers, initializer=_start_worker,
                                context=forks.context())

    async def check(self, body: bytes) -> Verdict:
        """The verdict on a POST /tune body. The event loop only hashes the bytes: parsing and checking run in
        the pool, since 200 large bodies parsed on the loop at once held /healthz for over a second."""
        key = hashlib.blake2b(body, digest_size=20).digest()
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        if self.pending >= self.settings.spec_check_queue:
            raise Busy(f"{self.pending} specs are being checked; retry in a few seconds")
        self.pending += 1
        timeout = self.settings.spec_check_timeout_s
        try:
            verdict = await asyncio.wrap_future(self.pool.schedule(check_body, (body, self.settings), timeout=timeout))
        except FutureTimeout:
            verdict = Verdict(errors=[("model", f"checking this spec took over {timeout:g}s (building the "
                                                "model's shape); use a smaller model")])
        except ProcessExpired as err:     # not cached: the machine may have been short of memory just now
            return Verdict(errors=[("model", f"the process checking this spec died ({err}); use a smaller "
                                             "model, or retry")])
        finally:
            self.pending -= 1
        if not verdict.cacheable:
            return verdict
        self.cache[key] = verdict
        if len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return verdict

    async def warm_up(self) -> None:
        """Start the pool's fork server and processes (importing torch and transformers: seconds) before
        the first request, not during it."""
        futures = [self.pool.schedule(check, ({"model": {"preset": "llama-tiny"}}, self.settings))
                   for _ in range(self.settings.spec_checkers)]
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

    def close(self) -> None:
        self.pool.stop()
        self.pool.join(timeout=10)
