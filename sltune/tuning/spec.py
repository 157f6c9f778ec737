"""The tuning job spec: one pydantic schema for SPEC.yaml and the JSON body of POST /tune.

Every error names the field and the fix. Parsing checks types, ranges and knobs that contradict each other, and
reads nothing but a model folder's config: a stored job is read back with it in milliseconds. The checks against
the model's shape and the cost model (seconds for a big config) are admission's (sltune.tuning.cost.admission), which
tune, plan and POST /tune run before a job is created.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      create_model, field_validator, model_validator)

from sltune.backend_knobs import BACKEND_KNOB, BACKENDS, KNOBS, BackendKnobs, BackendName
from sltune.config import Activations, DType, KVCache, OptimizerOffload, ParamOffload, RuntimeKnobs, Schedule
from sltune.field_errors import one_line
from sltune.models.presets import hf_config_schema
from sltune.profiling.schema import SPEEDLOADER_ONLY
from sltune.sizes import Bytes
from sltune.training.optimizer import OptimizerConfig
from sltune.tuning.knobs import MAX_KNOB_VALUES, Range, knob_values
from sltune.yamlfile import read_yaml

# a field a spec does not have: where its fields are named
UNKNOWN_SPEC_FIELD = "unknown field; check its spelling against the spec reference (docs/reference/spec.md)"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_booleans(cls, value: Any, info: Any) -> Any:
        """JSON's true and false are no numbers, nor 0 and 1 booleans, though pydantic reads each as the other
        (POST /tune queued jobs with search.seed false and search.profile 0): refused, as the schema says."""
        kinds = _leaves(cls.model_fields[info.field_name].annotation)
        if isinstance(value, bool) and not kinds & {bool, Any}:
            raise ValueError(f"{str(value).lower()} is not a number; give a number")
        if value is not None and not isinstance(value, bool) and kinds - {type(None)} == {bool}:
            raise ValueError(f"{_shown(value)} is not a boolean; give true or false")
        return value


def _shown(value: Any) -> str:
    """A value of a spec as its JSON or YAML writes it (null, true, [1, null], not Python's None, True); a string in
    quotes, as the messages quote a name ('nvme')."""
    return repr(value) if isinstance(value, str) else json.dumps(value, default=str)


def _leaves(annotation: Any) -> set:
    """The types an annotation admits, through unions, Annotated and containers' items."""
    args = get_args(annotation)
    return {annotation} if not args else set().union(*map(_leaves, args))


def _preset_names():
    from sltune.models import PRESETS

    return Literal[tuple(PRESETS)]


MAX_PATH = 4096


class ModelSpec(_Strict):
    """A preset name, an inline transformers config.json, or a Hugging Face model folder (its config.json, and
    its weights for the trials); never code. The server reads a folder only inside its models_dir setting
    (sltune.service.validation)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [  # exactly one source, as _one_source checks
        {"required": ["preset"], "properties": {"preset": {"type": "string"}}},
        {"required": ["hf_config"], "properties": {"hf_config": hf_config_schema()}},
        {"required": ["path"], "properties": {"path": {"type": "string"}}}]})

    preset: _preset_names() | None = None  # type: ignore[valid-type]
    hf_config: dict[str, Any] | None = None
    path: str | None = Field(None, min_length=1, max_length=MAX_PATH, description=(
        "a Hugging Face model folder: config.json, and model.safetensors or the shards model.safetensors.index.json "
        "lists, whose weights the trials load (a folder without weights trains random ones). A relative path is "
        "read from the current directory (`sltune tune`) or from the server's models_dir (POST /tune), which "
        "refuses any folder outside it"))
    dtype: DType = "float32"
    mixed_precision: bool = Field(True, description=(
        "with dtype bfloat16 or float16: float32 master weights, gradients and optimizer state on the host, "
        "the device computing in dtype (as SpeedLoaderConfig.mixed_precision); false keeps one copy in dtype"))

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSpec":
        from sltune.models import load_config

        if sum(x is not None for x in (self.preset, self.hf_config, self.path)) != 1:
            raise ValueError("give exactly one of model.preset (e.g. llama-tiny), model.hf_config (an inline "
                             "config.json) or model.path (a Hugging Face model folder)")
        if self.hf_config is not None:
            load_config(self.hf_config)    # checks family, refuses auto_map / remote code
        return self

    @field_validator("path")
    @classmethod
    def _folder(cls, value: str | None) -> str | None:
        return None if value is None else _model_folder(value)

    @property
    def source(self) -> str | dict[str, Any]:
        """What sltune.models.load_config and build take: the preset's name, the inline config, or the folder."""
        if self.preset is not None:
            return self.preset
        return self.hf_config if self.hf_config is not None else self.path

    def describe(self) -> str:
        if self.path is not None:
            return f"{Path(self.path).name} (model folder)"
        return self.preset or f"{self.hf_config.get('model_type')} (inline config)"


def _model_folder(path: str) -> str:
    """The folder as an absolute path without symlinks, once its config.json is one sltune accepts (no larger than
    any config, nested no deeper) and the weights it lists are files in it (sltune.models.checkpoint's reading
    checks: a weight_map naming a file through '..' or by an absolute path is refused). The messages never echo
    the path, nor the files the index names: on a server they are below the models_dir, which is the server's
    own business."""
    from sltune.models.checkpoint import INDEX, folder_config, weight_files

    try:
        folder = Path(path).expanduser().resolve()
        is_dir = folder.is_dir()
        has_config = is_dir and (folder / "config.json").is_file()
    except (OSError, ValueError, RuntimeError):     # a path the system cannot even look up (a symlink loop, ...)
        is_dir = has_config = False
    if not is_dir:
        raise ValueError("no such folder; give a Hugging Face model folder (config.json, and "
                         "model.safetensors or its shards for the weights)")
    if not has_config:
        raise ValueError("the folder has no config.json; give a Hugging Face model folder (one "
                         "save_pretrained wrote)")
    folder_config(folder, source="its config.json")    # checks family, refuses auto_map / remote code
    missing = [f for f in weight_files(folder, source=f"its {INDEX}") if not f.is_file()]
    if missing:
        raise ValueError(f"its {INDEX} lists {len(missing)} shard file(s) the folder does not hold; copy them in, "
                         "or re-save the model with save_pretrained")
    return str(folder)


class Workload(_Strict):
    mode: Literal["train", "generate"] = "train"
    seq_len: int = Field(128, ge=2, description="train: tokens per row")
    prompt_len: int = Field(32, ge=1, description="generate: prompt tokens per row")
    new_tokens: int = Field(16, ge=1, description="generate: tokens generated per row")

    @property
    def tokens_per_row(self) -> int:
        return self.seq_len if self.mode == "train" else self.prompt_len + self.new_tokens


# a trial runs every rank as a process on one machine: more ranks than the largest machines' cores is no trial any
# machine runs, and the predictions' cost grows with the ranks (524,289 held a server's spec check for 20 s)
MAX_WORLD_SIZE = 1024
MAX_PARALLEL_TRIALS = 256       # a trial's thread each in the runner, and a cluster's nodes for each


class Hardware(_Strict):
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d{1,2})?)$", description="cpu, cuda or cuda:N")
    device_memory_limit: Bytes | None = None
    host_memory_limit: Bytes | None = None
    world_size: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description=(
        "ranks each trial runs, all on one machine (a process each: one GPU each on cuda, sharing the cores on "
        "the cpu); a server allows at most its SLTUNE_MAX_WORLD_SIZE, by default its cores"))
    cpu_threads: int | None = Field(None, ge=1, description="torch intra-op threads per trial; default all cores")
    executor: Literal["local", "ray"] = Field("local", description=(
        "where trials run: local (this machine; a server's worker's) or ray (the nodes of the Ray cluster at "
        "SLTUNE_RAY_ADDRESS or RAY_ADDRESS; pip install -e '.[ray]'). Measurements from different machines are not "
        "comparable: a job's trials run on nodes alike"))
    nodes: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description=(
        "machines each trial's ranks span, ranks_per_node on each in rank order (hardware.executor ray: a placement "
        "group puts them on as many distinct nodes)"))
    ranks_per_node: int | None = Field(None, ge=1, le=MAX_WORLD_SIZE, description=(
        "ranks on each node; world_size is nodes x ranks_per_node (default: world_size / nodes)"))
    parallel_trials: int = Field(1, ge=1, le=MAX_PARALLEL_TRIALS, description=(
        "trials a job runs at once, each on nodes of its own (hardware.executor ray; nodes alike: their trials are "
        "compared): the trials whose choice waits on no other's result (oneshot's probes, the grid, random and tpe's "
        "samples); the confirmation round runs one trial at a time on one node, the first's"))
    disk_limit: Bytes | None = Field(None, description=(
        "search.optimizer_offload or search.param_offload disk: the room a trial's files may take (the master and "
        "optimizer state, and under param_offload disk the weights, twice while a step writes its new version; the "
        "gradients once when a step waits for all of them); default: the free space where trials offload to, and "
        "never more than it"))

    @model_validator(mode="after")
    def _nodes(self) -> "Hardware":
        """world_size, nodes and ranks_per_node: any two give the third; three must agree."""
        if self.ranks_per_node is not None:
            world = self.nodes * self.ranks_per_node
            if "world_size" in self.model_fields_set and self.world_size != world:
                raise ValueError(f"hardware.world_size {self.world_size} is not nodes x ranks_per_node = {world}; "
                                 "give two of the three")
            if world > MAX_WORLD_SIZE:
                raise ValueError(f"hardware.nodes x ranks_per_node is {world} ranks, above {MAX_WORLD_SIZE}")
            self.world_size = world
        elif self.world_size % self.nodes:
            raise ValueError(f"hardware.world_size {self.world_size} does not split over {self.nodes} nodes; make it "
                             "a multiple of hardware.nodes, or give hardware.ranks_per_node")
        if self.parallel_trials > 1 and self.executor != "ray":
            raise ValueError(f"hardware.parallel_trials: {self.parallel_trials} trials at once need nodes of their "
                             "own: set hardware.executor ray (trials side by side on one machine measure each other)")
        if self.nodes > 1 and self.executor != "ray":
            raise ValueError(f"hardware.nodes: {self.nodes} nodes need a cluster: set hardware.executor ray (this "
                             "machine is one node)")
        return self

    @property
    def per_node(self) -> int:
        """Ranks on each node."""
        return self.world_size // self.nodes

    @property
    def device_kind(self) -> str:
        return self.device.split(":")[0]


MAX_CANDIDATES = 20_000
MAX_FINALISTS = 3               # configs each confirmation round re-measures at most (the leader and two rivals)
# the largest value of a batch knob (rows, sub-batches, live blocks): 2**20 rows of even 2 tokens are more than
# any step runs, and past 2**63 the footprint's traced tensors cannot even be sized (a 500 from torch)
MAX_KNOB = 2**20


def _knob(value: Any) -> Any:
    """One clear message per knob, not one per member of the union."""
    if isinstance(value, Range):
        return _at_most_max_knob(value, [value.max])
    if isinstance(value, dict):
        try:
            knob = Range(**value)
        except ValidationError as err:
            raise ValueError(one_line(err, unknown=UNKNOWN_SPEC_FIELD)) from None
        return _at_most_max_knob(knob, [knob.max])
    if isinstance(value, int) and not isinstance(value, bool):
        return _at_most_max_knob(value, [value])
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if len(value) > MAX_KNOB_VALUES:
            raise ValueError(f"at most {MAX_KNOB_VALUES} values per knob, got {len(value)}; use {{min, max}}")
        return _at_most_max_knob(value, value)
    raise ValueError(f"expected an integer, a list of integers or {{min: ..., max: ...}}, got {value!r}")


def _at_most_max_knob(knob: Any, values: list[Any]) -> Any:
    if any(isinstance(v, int) and v > MAX_KNOB for v in values):
        raise ValueError(f"values must be at most {MAX_KNOB} (2**20), far more than any step runs; lower it")
    return knob


Knob = Annotated[int | Range | list[int], BeforeValidator(_knob)]


def _shares(value: Any) -> Any:
    """search.weights_on_device: one share or a list of them, each from 0 to 1, as a sorted list without
    repeats; one clear message for any bad value."""
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ValueError("give a share from 0 to 1 or a list of them, such as [0, 0.5, 1], not an empty list")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ValueError(f"{_shown(v)} is not a share of the parameter bytes; give numbers from 0 (keep none on "
                             "the device) to 1 (keep them all), such as [0, 0.5, 1]")
    if len(values) > MAX_KNOB_VALUES:
        raise ValueError(f"at most {MAX_KNOB_VALUES} values per knob, got {len(values)}")
    return sorted({float(v) for v in values})


def _probe_layers(value: Any) -> Any:
    """search.probe_layers: auto, a number of layers, or nothing (the whole model); one clear message otherwise."""
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"{value!r} is neither auto nor a number of decoder layers; give auto, an integer such as 4, "
                     "or leave it out to probe the whole model")


DISK_LIMIT_WITHOUT_DISK = ("bounds the files of search.optimizer_offload or search.param_offload disk (or of "
                           "DeepSpeed's nvme offload), which this spec does not try; add disk to "
                           "search.optimizer_offload (e.g. [host, disk]) or remove it")


def _places(what: str) -> Any:
    """search.optimizer_offload, search.param_offload: host, disk or both, as a list in that order; one clear message
    for any bad value. `what` lives there."""
    def check(value: Any) -> Any:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values:
            raise ValueError(f"{_shown(value)} is not a list of places; give host, disk or [host, disk]")
        for v in values:
            if v not in ("host", "disk"):
                raise ValueError(f"{_shown(v)} is not where {what} can live; give host, disk or [host, disk]")
        return [v for v in ("host", "disk") if v in values]
    return BeforeValidator(check)


_offloads = _places("the optimizer's master and state")


def _backends(value: Any) -> Any:
    """search.backend: one backend or a list, as a list in BACKENDS' order without repeats (so the same choice
    written in another order is the same job); one clear message for any bad value."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values:
        raise ValueError(f"{_shown(value)} is not a backend or a list of them; give speedloader, deepspeed, fsdp or "
                         "a list such as [speedloader, fsdp]")
    for v in values:
        if v not in BACKENDS:
            raise ValueError(f"{_shown(v)} is not a backend; choose from {', '.join(BACKENDS)}")
    return [b for b in BACKENDS if b in values]


def _choices(allowed: tuple[Any, ...], example: str) -> Any:
    """A backend knob's values: one value or a list of them, as a list in `allowed`'s order without repeats. A
    boolean is no stage number, nor 0 or 1 a boolean (JSON tells them apart; Python's `in` would not)."""
    booleans = isinstance(allowed[0], bool)

    def check(value: Any) -> list[Any]:
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ValueError(f"give {example}, not an empty list")
        for v in values:
            if isinstance(v, bool) != booleans or v not in allowed:
                listed = ", ".join(json.dumps(a) for a in allowed)
                raise ValueError(f"{json.dumps(v, default=str)} is not one of {listed}; give {example}")
        return [a for a in allowed if a in values]
    return BeforeValidator(check)


def _search_section(backend: str, name: str, doc: str) -> type[BaseModel]:
    """search.<backend>: each of the backend's knobs as BackendKnobs declares it, a value or a list of them to sweep,
    by default the declaration's search values."""
    fields: dict[str, Any] = {}
    for knob in KNOBS[backend]:
        declared = BACKEND_KNOB[knob]
        allowed = _values_of(BackendKnobs.model_fields[knob].annotation)
        example = f"{_listed(allowed)} or a list such as [{_listed(allowed[:2])}]"
        fields[knob] = (Annotated[list[Literal[allowed]], _choices(allowed, example)],  # type: ignore[valid-type]
                        Field(default_factory=lambda values=declared.search: list(values),
                              description=f"{declared.doc}; a value or a list, default [{_listed(declared.search)}]"))
    return create_model(name, __config__=ConfigDict(extra="forbid"), __doc__=doc, __module__=__name__, **fields)


def _listed(values: tuple[Any, ...]) -> str:
    """Values as a spec writes them, unquoted: none, cpu; false, true; 2, 3."""
    return ", ".join(v if isinstance(v, str) else json.dumps(v) for v in values)


def _values_of(annotation: Any) -> tuple[Any, ...]:
    """The values a backend knob's type admits: a Literal's, or a boolean's two."""
    (kind,) = (a for a in get_args(annotation) if a is not type(None))
    return (False, True) if kind is bool else get_args(kind)


DeepSpeedSearch = _search_section("deepspeed", "DeepSpeedSearch", """search.deepspeed: the ZeRO knobs a job sweeps
    under backend deepspeed (a value or a list each). A combination that makes no run (offload_param beyond none at
    ZeRO-2) is no candidate. nvme swaps to files in the trial's offload folder, the runner's, and needs libaio
    (checked when the job is admitted).""")
FSDPSearch = _search_section("fsdp", "FSDPSearch", """search.fsdp: the FSDP2 knobs a job sweeps under backend fsdp
    (a boolean or a list each).""")


def _sweeps(backend: str) -> str:
    """What a backend's search section sweeps when it is left out, as its doc says it."""
    return ", ".join(f"{knob} [{_listed(BACKEND_KNOB[knob].search)}]" for knob in KNOBS[backend])


BACKEND_SECTIONS: dict[str, type[BaseModel]] = {"deepspeed": DeepSpeedSearch, "fsdp": FSDPSearch}


def _swept(knob: str, default: Range | None, how: str = "") -> Any:
    """search.<knob>, a batch knob of the runtime the search sweeps: its doc is the knob's own (RuntimeKnobs), what
    a spec may give, and its default, so that the reference pages say it once."""
    shown = f"{{min: {default.min}, max: {default.max}}}" if default else "none"
    made = {"default_factory": default.model_copy} if default else {"default": None}
    return Field(**made, description=(
        f"{RuntimeKnobs.model_fields[knob].description}. The values to try: a number, a list, or {{min, max}} (the "
        f"powers of two between them, and both ends); default {shown}{how}"))


# what search.num_sub_batches tries when neither it nor search.effective_batch_size is given
SUB_BATCHES = Range(min=1, max=16)

Share = Annotated[float, Field(ge=0.0, le=1.0)]
Shares = Annotated[Share | Annotated[list[Share], Field(min_length=1, max_length=MAX_KNOB_VALUES)],
                   BeforeValidator(_shares)]


class Search(_Strict):
    strategy: Literal["oneshot", "grid", "random", "tpe"] = "oneshot"
    schedule: Schedule = "speedloader"
    backend: Annotated[list[BackendName], BeforeValidator(_backends)] = Field(
        default_factory=lambda: ["speedloader"], min_length=1, description=(
            "what trains: speedloader, deepspeed (ZeRO: `bash scripts/install.sh backends`) or fsdp (PyTorch "
            "FSDP2), or a list: the job profiles each on this machine over the same batch knobs and picks the "
            "fastest (its result's best_by_backend holds each one's best). num_live_blocks, schedule, "
            "optimizer_offload and param_offload are SpeedLoader's"))
    deepspeed: DeepSpeedSearch | None = Field(None, description=(  # type: ignore[valid-type]
        f"backend deepspeed: the ZeRO knobs to sweep; default {_sweeps('deepspeed')}"))
    fsdp: FSDPSearch | None = Field(None, description=(  # type: ignore[valid-type]
        f"backend fsdp: the FSDP2 knobs to sweep; default {_sweeps('fsdp')}"))
    sub_batch_size: Knob = _swept("sub_batch_size", Range(min=1, max=16))
    num_sub_batches: Knob | None = _swept("num_sub_batches", None, (
        f", which tries {{min: {SUB_BATCHES.min}, max: {SUB_BATCHES.max}}} unless effective_batch_size is given"))
    effective_batch_size: Knob | None = Field(None, description=(
        "rows per optimizer step (B = b*N), instead of num_sub_batches: each sub_batch_size that divides a value runs "
        "B/b sub-batches. The values to try: a number, a list, or {min, max}"))
    num_live_blocks: Knob = _swept("num_live_blocks", Range(min=1, max=4), " (a value past the model's layers is "
                                   "its layers)")
    activations: Annotated[list[Activations], BeforeValidator(lambda v: [v] if isinstance(v, str) else v)] = Field(
        default_factory=lambda: ["recompute"], min_length=1,
        description="recompute | offload, or a list of both to sweep (host memory and traffic against FLOPs)")
    kv_cache: KVCache | list[KVCache] | None = Field(
        None, description="generate: where KV caches may live; default both, host and device")
    weights_on_device: Shares | None = Field(
        None, description="generate: shares of the parameter bytes to keep on the device for a whole generate call "
        "(0 to 1, whole units: tied weights, embedding, head, then groups of num_live_blocks layers), one or a "
        "list to sweep; default 0, 0.5 and 1. Kept weights are copied in once per call instead of at every step")
    optimizer_offload: Annotated[list[OptimizerOffload], _offloads] = Field(
        default_factory=lambda: ["host"], min_length=1, description=(
            "training: where the float32 master and the optimizer state live, host memory or files on disk "
            "(under the job's data directory), or [host, disk] to let the tuner decide: disk trades host memory "
            "for disk traffic, bounded by hardware.disk_limit"))
    param_offload: Annotated[list[ParamOffload], _places("the dtype copy of the weights")] = Field(
        default_factory=lambda: ["host"], min_length=1, description=(
            "where the dtype copy of the weights the device loads lives: host memory, or a file per unit (under "
            "the job's data directory) read ahead into a window of a few units, or [host, disk] to let the tuner "
            "decide: disk holds a window of the weights and of the gradients in host memory instead of the whole "
            "model, for reads of the weights every step. Training needs disk in search.optimizer_offload too (a "
            "config of the weights on disk has its optimizer on disk)"))
    max_trials: int = Field(20, ge=1)
    trial_steps: int = Field(2, ge=1, le=100_000, description="timed steps per trial at least")
    trial_min_time_s: float = Field(2.0, ge=0, le=3600, description="time a trial's steps until they add up to this")
    trial_max_steps: int = Field(100, ge=1, le=100_000, description="timed steps per trial at most")
    confirm_rounds: int = Field(3, ge=0, le=20, description="interleaved re-measurements of the finalists "
                                                            "before the job ends (0: none)")
    trial_timeout_s: float = Field(300.0, gt=0, description=(
        "a trial still running after this many seconds is stopped (status timeout); a search guided by the step-time "
        "prior starts no config predicted to outlast it"))
    time_budget_s: float = Field(600.0, gt=0)
    margin: float = Field(0.05, ge=0.0, lt=1.0, description="predicted peaks within this fraction of a limit "
                                                            "count as over it")
    profile: bool = Field(True, description="profile one step per trial (the breakdown and trace)")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seeds the samplers and the trials' data (numpy's range)")
    probe_layers: Annotated[Literal["auto"] | int | None, BeforeValidator(_probe_layers)] = Field(
        None, description="oneshot: run the probes with this many decoder layers (the model's widths, fewer "
        "layers; at least two groups of the largest num_live_blocks), or auto: reduce depth only when a full-depth "
        "probe would be slow. Frontier and confirmation trials run the whole model. Default: the whole model")
    step_prior: Literal["stored", "measure", "off"] = Field("stored", description=(
        "oneshot: rank every config of every backend by its step predicted from this machine's calibrated rates, "
        "measure each backend's top predicted config first, and stop once no unmeasured config can beat the best "
        "measured (its prediction corrected by the trials so far, allowing that correction's error); no probes. "
        "stored: where `sltune calibrate SPEC` stored fresh rates for the spec's shapes, else the probes' fits; "
        "measure: the job measures the rates it lacks before its first trial (within search.time_budget_s, at "
        "most a minute); off: the probes' fits alone, and no step predicted on the trial pages"))

    @model_validator(mode="after")
    def _batch(self) -> "Search":
        if self.num_sub_batches is not None and self.effective_batch_size is not None:
            raise ValueError("give search.num_sub_batches or search.effective_batch_size, not both")
        if self.num_sub_batches is None and self.effective_batch_size is None:
            self.num_sub_batches = SUB_BATCHES.model_copy()
        self.activations = list(dict.fromkeys(self.activations))
        for name in ("sub_batch_size", "num_sub_batches", "effective_batch_size", "num_live_blocks"):
            value = getattr(self, name)
            if value is not None:
                knob_values(value, name)
        if isinstance(self.kv_cache, list) and not self.kv_cache:
            raise ValueError("search.kv_cache: give host, device or both, not an empty list")
        return self

    def kv_cache_values(self, mode: str) -> list[str]:
        """The KV placements to sweep: none in training; in generation the spec's, host then device."""
        if mode != "generate":
            return []
        chosen = [self.kv_cache] if isinstance(self.kv_cache, str) else self.kv_cache or ["host", "device"]
        return [kv for kv in ("host", "device") if kv in chosen]

    def weights_on_device_values(self, mode: str) -> list[float]:
        """The shares of the weights to keep on the device: none in training or under the resident schedule
        (which keeps them all); in generation the spec's, else none, half and all."""
        if mode != "generate" or self.schedule == "resident":
            return []
        return self.weights_on_device or [0.0, 0.5, 1.0]     # _shares made it a list

    def optimizer_offload_values(self, mode: str) -> list[str]:
        """Where the optimizer may live: the spec's places in training; generation steps no optimizer."""
        return list(self.optimizer_offload) if mode == "train" else ["host"]

    def param_offload_values(self, mode: str) -> list[str]:
        """Where the weights may live: the spec's places, in training and generation alike (training pairs disk
        with the optimizer on disk: SearchSpace)."""
        return list(self.param_offload)

    def backend_values(self, backend: str) -> dict[str, list[Any]]:
        """Each knob of `backend` with the values to sweep: its search section's, else the defaults ({} for
        speedloader, whose knobs are the fields above)."""
        if backend not in BACKEND_SECTIONS:
            return {}
        section = getattr(self, backend) or BACKEND_SECTIONS[backend]()
        return {knob: list(getattr(section, knob)) for knob in KNOBS[backend]}

    def backend_variants(self, backend: str) -> list[dict[str, Any]]:
        """Every combination of the backend's knob values that makes a run, in the order of the values: offload_param
        beyond none offloads ZeRO-3's partitions, so at zero_stage 2 it is no candidate. [{}] for speedloader."""
        values = self.backend_values(backend)
        combos: list[dict[str, Any]] = [{}]
        for knob, choices in values.items():
            combos = [{**c, knob: v} for c in combos for v in choices]
        return [c for c in combos if c.get("offload_param", "none") == "none" or c.get("zero_stage") == 3]


def _no_bools(value: Any) -> Any:
    """JSON's true is not a number: every field of the optimizer section is a name or numbers."""
    if isinstance(value, dict):
        for key in (f for f in OptimizerConfig.model_fields if f != "name"):    # the name is a Literal
            v = value.get(key)
            if isinstance(v, bool) or (isinstance(v, (list, tuple)) and any(isinstance(x, bool) for x in v)):
                raise ValueError(f"{key} is true or false; give a number")
    return value


# the search fields only SpeedLoader's engine has (its knobs, and the probes at reduced depth that scale its groups):
# a spec without backend speedloader that sets one is refused
SPEEDLOADER_FIELDS = (*(f for f in SPEEDLOADER_ONLY if f in Search.model_fields), "probe_layers")


class TuningSpec(_Strict):
    name: str = Field("tuning-job", min_length=1, max_length=200, pattern=r"^[^\x00-\x1f]+$")
    model: ModelSpec
    workload: Workload = Field(default_factory=Workload)
    hardware: Hardware = Field(default_factory=Hardware)
    search: Search = Field(default_factory=Search)
    optimizer: Annotated[OptimizerConfig, BeforeValidator(_no_bools)] = Field(
        default_factory=OptimizerConfig, description="what the training job steps with, and so what the trials "
        "run: adamw (default) or sgd with their hyperparameters; best.yaml carries it to `sltune train`")
    objective: Literal["tokens_per_s"] = "tokens_per_s"

    @model_validator(mode="after")
    def _consistent(self) -> "TuningSpec":
        """The knobs that contradict each other or the mode, and a space too large to search: all without the
        model's shape (the checks that need it, and the cost model, are sltune.tuning.cost.admission's)."""
        mode = self.workload.mode
        hw = self.hardware
        if hw.world_size > 1 and self.workload.mode == "generate":
            raise ValueError("hardware.world_size > 1 is for training; generation runs on one process")
        if mode == "train" and self.search.kv_cache is not None:
            raise ValueError("search.kv_cache places generation's KV caches; remove it or set workload.mode: generate")
        if mode == "train" and self.search.weights_on_device is not None:
            raise ValueError("search.weights_on_device keeps generation's weights on the device; remove it or set "
                             "workload.mode: generate")
        if "disk" in self.search.optimizer_offload and mode != "train":
            raise ValueError("search.optimizer_offload: disk holds a training optimizer's state, and generation "
                             "steps none; remove it or set workload.mode: train")
        if "disk" in self.search.optimizer_offload and self.search.schedule == "resident":
            raise ValueError("search.optimizer_offload: the resident schedule steps its optimizer on the device, "
                             "so disk cannot hold it; use host, or search.schedule speedloader or canonical")
        ds = self.search.backend_values("deepspeed") if "deepspeed" in self.search.backend else {}
        nvme = "nvme" in (*ds.get("offload_optimizer", ()), *ds.get("offload_param", ()))
        if hw.disk_limit is not None and "disk" not in self.search.optimizer_offload \
                and "disk" not in self.search.param_offload and not nvme:
            raise ValueError(f"hardware.disk_limit {DISK_LIMIT_WITHOUT_DISK}")
        if hw.world_size > 1 and self.search.schedule == "resident":
            raise ValueError("search.schedule 'resident' keeps every parameter on every rank; with "
                             "hardware.world_size > 1 use 'speedloader' or 'canonical'")
        search = self.search
        self._backends_consistent()
        self._weights_on_disk()
        common = len(search.activations)
        for knob in (search.sub_batch_size, search.num_sub_batches or search.effective_batch_size):
            common *= len(knob_values(knob, "knob"))
        size = 0
        if "speedloader" in search.backend:
            size = common * len(knob_values(search.num_live_blocks, "knob"))
            size *= max(1, len(search.kv_cache_values(mode)))
            size *= max(1, len(search.weights_on_device_values(mode)))
            places = [(o, p) for o in search.optimizer_offload_values(mode) for p in search.param_offload_values(mode)
                      if not (mode == "train" and p == "disk" and o != "disk")]
            size *= len(places)
        size += sum(common * len(search.backend_variants(b)) for b in search.backend if b != "speedloader")
        if size > MAX_CANDIDATES:
            raise ValueError(f"the search space has {size} combinations, more than {MAX_CANDIDATES}; narrow the "
                             "search.* ranges or lists")
        return self

    def _weights_on_disk(self) -> None:
        """search.param_offload disk against what the runtime runs it with: a schedule that loads the weights (not
        resident), and in training the optimizer on disk (sltune.config)."""
        if "disk" not in self.search.param_offload:
            return
        if self.search.schedule == "resident":
            raise ValueError("search.param_offload: the resident schedule keeps every weight on the device, so disk "
                             "cannot hold them; use host, or search.schedule speedloader or canonical")
        if self.workload.mode == "train" and "disk" not in self.search.optimizer_offload:
            raise ValueError("search.param_offload disk: training steps each unit's weights file with its "
                             "optimizer block, and search.optimizer_offload has no disk; add disk to "
                             "search.optimizer_offload (e.g. [host, disk]), or use host")

    def _backends_consistent(self) -> None:
        """search.backend against the rest of the spec: a backend's section without the backend, SpeedLoader's fields
        without speedloader, and what the wrapped backends do not run (generation, float16 under FSDP, one dtype copy
        without a float32 master); a deepspeed section with no runnable combination."""
        search, backends = self.search, self.search.backend
        others = [b for b in backends if b != "speedloader"]
        listed = f"search.backend [{', '.join(backends)}]"
        for name in BACKEND_SECTIONS:
            if getattr(search, name) is not None and name not in backends:
                raise ValueError(f"search.{name} sets the {name} backend's knobs, and {listed} does not include "
                                 f"{name}; add {name} to search.backend, or remove search.{name}")
        if "speedloader" not in backends:       # set to another value than its default (best.yaml names them all)
            for field in SPEEDLOADER_FIELDS:
                if field in search.model_fields_set and getattr(search, field) != getattr(Search(), field):
                    raise ValueError(f"search.{field} is SpeedLoader's, and {listed} does not include speedloader; add "
                                     f"speedloader to search.backend, or remove search.{field}")
        if not others:
            return
        if self.workload.mode != "train":
            raise ValueError(f"search.backend: {others[0]} trains only; generation (workload.mode generate) is "
                             "SpeedLoader's: use backend speedloader alone, or workload.mode train")
        if search.probe_layers is not None:
            raise ValueError(f"search.probe_layers: probes at reduced depth are SpeedLoader's (their fits scale its "
                             f"groups with depth), and {listed} includes {others[0]}; remove search.probe_layers, or "
                             "use backend speedloader alone")
        dtype = self.model.dtype
        if dtype != "float32" and not self.model.mixed_precision:
            raise ValueError(f"model.mixed_precision: backend {others[0]} keeps float32 master weights under {dtype}; "
                             f"set it true, or drop {others[0]} from search.backend")
        if "fsdp" in backends and dtype == "float16":
            raise ValueError("model.dtype: float16 needs loss scaling, which the fsdp backend does not run; use "
                             "bfloat16 (its MixedPrecisionPolicy) or float32, or drop fsdp from search.backend")
        if "deepspeed" in backends and not search.backend_variants("deepspeed"):
            raise ValueError("search.deepspeed.offload_param: cpu and nvme offload ZeRO-3's parameter partitions, and "
                             "search.deepspeed.zero_stage has no 3; add 3 to zero_stage, or none to offload_param")

    def digest(self) -> str:
        """Identifies the job: the same spec re-run resumes the same job. Fields left at their defaults are left out,
        so a field a later sltune adds (with a default that keeps today's behaviour) does not orphan a job."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json", exclude_defaults=True), sort_keys=True)
                              .encode()).hexdigest()

    @classmethod
    def load(cls, path: str | Path) -> "TuningSpec":
        return cls.parse(read_yaml(path), source=str(path))

    @classmethod
    def parse(cls, data: Any, source: str = "spec") -> "TuningSpec":
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping with model, workload, hardware and search")
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ValueError(f"{source}: " + one_line(err, unknown=UNKNOWN_SPEC_FIELD)) from None

