"""Hugging Face folders in and out: config.json plus safetensors, one file or shards listed by an index.

In: the model is built with its parameters on the meta device (nothing allocated, nothing initialised; buffers
such as rotary frequencies are computed as usual), and the engine fills its own host buffers tensor by tensor
from the memory-mapped files, casting as it copies: no random init and no second full copy of the weights. One
file is mapped at a time, so what the mapping adds to resident memory is at most one shard.

Out: the same layout transformers writes (`save_pretrained`): shards of at most max_shard_size with an index
above it, config.json carrying the saved dtype, the generation config, and the tokenizer files of the folder
the weights came from (a training run writes the tokenizer it read at its start instead: the folder it resumed
from may be pruned or be the one written). Files are written under temporary names and renamed into place, so a
crash leaves either the old file or the new one.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError
from torch import nn

from sltune.models import confined

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# what a tokenizer (and chat template) saved beside a model is made of: copied with the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
# bounds on what reading a folder's config and index may cost (a server checks the folders specs name): far above
# any real one's (a config.json holds a few KB; an index ~100 bytes a tensor, a few thousand tensors in the largest
# open models, in at most a few hundred shards)
MAX_CONFIG_BYTES = 2**20
MAX_INDEX_BYTES = 8 * 2**20
MAX_SHARDS = 4096


class Checkpoint:
    """A Hugging Face model folder: its config and where each tensor lives."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"--model {path}: not a folder; give a Hugging Face model folder (config.json and "
                             "model.safetensors), a config.json or a preset name")
        self.config = folder_config(self.path)
        self.files: dict[str, Path] = {}
        index, single = self.path / INDEX, self.path / WEIGHTS
        if index.is_file():
            self.files = read_index(self.path)
            missing = sorted({str(f) for f in self.files.values() if not f.is_file()})
            if missing:
                raise ValueError(f"{index} lists shards that are not there: {', '.join(missing[:3])}")
        elif single.is_file():
            self.files = dict.fromkeys(_keys(single), single)
        elif any(self.path.glob("pytorch_model*.bin")):
            raise ValueError(f"{self.path} holds pytorch_model.bin weights; sltune reads safetensors only: re-save "
                             "them with model.save_pretrained(folder) (safetensors is transformers' default)")

    def use_weights(self, file: Path) -> None:
        """Read the tensors from this safetensors file instead (a resumed job's exact float32 weights)."""
        self.files = dict.fromkeys(_keys(file), file)

    @property
    def has_weights(self) -> bool:
        return bool(self.files)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype the floating weights are stored in (the first one's)."""
        for name, file in self.files.items():
            with _safe_open(file) as f:
                code = f.get_slice(name).get_dtype()
            if code in _DTYPES and code != "F64":
                return _DTYPES[code]
        return None

    def empty_model(self) -> nn.Module:
        """The model with its parameters on the meta device and its buffers real."""
        from transformers import AutoModelForCausalLM

        with parameters_on_meta():
            return AutoModelForCausalLM.from_config(self.config)

    @contextlib.contextmanager
    def reader(self, model: nn.Module) -> Iterator[Callable[[nn.Parameter, torch.Tensor], None]]:
        """`fill(p, dst)`: parameter p's tensor from the checkpoint (under any of its names, for tied weights)
        copied into dst, cast as it is copied, one file mapped at a time. Every parameter must be there with the
        model's shape."""
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        chosen: dict[int, str] = {}
        missing = []
        for key, aliases in names.items():
            found = next((n for n in aliases if n in self.files), None)
            if found is None:
                missing.append(aliases[0])
            else:
                chosen[key] = found
        if missing:
            raise ValueError(f"{self.path}: the checkpoint has no tensor for {', '.join(missing[:4])}"
                             f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}; is it a "
                             f"{self.config.model_type} checkpoint saved by transformers?")
        state: dict[str, Any] = {"file": None, "handle": None, "open": contextlib.ExitStack()}

        def fill(p: nn.Parameter, dst: torch.Tensor) -> None:
            name = chosen[id(p)]
            file = self.files[name]
            if state["file"] != file:
                close()
                state["handle"] = state["open"].enter_context(_safe_open(file))
                state["file"] = file
            tensor = state["handle"].get_tensor(name)
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(f"{file}: {name} has shape {tuple(tensor.shape)} but config.json makes it "
                                 f"{tuple(p.shape)}; the weights and the config are of different models")
            dst.copy_(tensor)

        def close() -> None:
            state["open"].close()
            state["file"] = state["handle"] = None

        try:
            yield fill
        finally:
            close()


def folder_config(folder: Path, source: str | None = None):
    """The transformers config of a model folder's config.json, as load_config checks it; refused (ValueError,
    naming `source`, default the file's path) when the file is larger than any config (MAX_CONFIG_BYTES: a 70 MB
    one held a server's spec check for 20 s) or, as load_config says, nested deeper than Python's parser reads."""
    from sltune.models.presets import load_config

    source = source or str(folder / "config.json")
    _bounded(folder / "config.json", MAX_CONFIG_BYTES, source, "transformers config.json")
    return load_config(folder, source=source)


def read_index(folder: Path, source: str | None = None) -> dict[str, Path]:
    """The index's weight_map: each tensor's name and the file in `folder` that holds it. ValueError, naming
    `source` (default: the index's path) and never the files it names, when the index is larger than any
    (MAX_INDEX_BYTES), is not JSON, has no weight_map mapping names to file names, lists more than MAX_SHARDS
    files, or names a file outside the folder (an absolute path, or one through '..'): a checkpoint's shards are
    files in its folder, and a model folder is all that is read of it. Nothing here opens a shard."""
    index = folder / INDEX
    source = source or str(index)
    _bounded(index, MAX_INDEX_BYTES, source, "safetensors index")
    try:
        data = json.loads(confined.read_bytes(index))
    except RecursionError:
        data = None
    except ValueError as err:       # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{source}: not valid JSON ({err}); re-save the model with save_pretrained") from None
    except OSError as err:
        raise ValueError(f"{source}: cannot be read ({err.strerror or type(err).__name__})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise ValueError(f"{source}: not a safetensors index: its weight_map must map each tensor's name to the "
                         "file holding it ({\"model.norm.weight\": \"model-00002-of-00002.safetensors\", ...}); "
                         "re-save the model with save_pretrained")
    names = set(weight_map.values())
    if len(names) > MAX_SHARDS:
        raise ValueError(f"{source}: lists {len(names)} shard files, more than the {MAX_SHARDS} any model has; "
                         "re-save the model with save_pretrained (max_shard_size a few GB)")
    outside = [n for n in names if not _in_folder(n)]
    if outside:
        raise ValueError(f"{source}: the weight_map names {len(outside)} file(s) outside the model folder (an "
                         "absolute path, or one through '..'); a checkpoint's shards are files in its folder: "
                         "move them there and name them relative to it, or re-save the model with save_pretrained")
    files = {n: folder / n for n in names}
    return {tensor: files[n] for tensor, n in weight_map.items()}


def weight_files(folder: Path, source: str | None = None) -> list[Path]:
    """The files a Checkpoint of `folder` reads the weights from (read_index's checks): the index's shards, else
    model.safetensors, else none; each inside the folder by its name (a symlink is followed where it leads)."""
    if (folder / INDEX).is_file():
        return sorted(set(read_index(folder, source).values()))
    return [folder / WEIGHTS] if (folder / WEIGHTS).is_file() else []


def _in_folder(name: str) -> bool:
    """Whether a file name from an index stays in the folder it is read against: relative, no '..', no NUL."""
    path = PurePosixPath(name)
    return bool(name) and "\x00" not in name and not path.is_absolute() and ".." not in path.parts


def _bounded(file: Path, limit: int, source: str, what: str) -> None:
    """ValueError when `file` is larger than `limit` bytes (a missing file is the reader's to report)."""
    try:
        size = file.stat().st_size
    except (OSError, ValueError):
        return
    if size > limit:
        from sltune.sizes import format_bytes

        raise ValueError(f"{source}: {format_bytes(size)}, larger than any {what} (at most {format_bytes(limit)}); "
                         "give the one save_pretrained writes")


def _keys(file: Path) -> list[str]:
    try:
        with _safe_open(file) as f:
            return list(f.keys())
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from None


@contextlib.contextmanager
def _safe_open(file: Path) -> Iterator[Any]:
    """safetensors' handle on a weights file, the file checked inside the server's models_dir (if the reading is
    confined: sltune.models.confined) as it is opened."""
    from safetensors import safe_open

    with confined.opened(file) as name, safe_open(name, framework="pt") as f:
        yield f


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the meta device; buffers stay real. (The parameter is
    created first, uninitialised, and replaced at once: its pages are never touched.)"""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(model: nn.Module) -> None:
    """Meta parameters become uninitialised host ones (tied ones stay one object), so the engine can point them
    at its buffers; the allocation is virtual until written, and the engine never writes it."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]


def write_pretrained(path: str | Path, model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype,
                     max_shard_size: int | str = "5GB", source: Path | None = None,
                     metadata: dict[str, str] | None = None, staged: bool = True) -> list[Path]:
    """Write `state` (each tensor once: tied names already dropped) as a Hugging Face folder in `dtype`; returns
    the weight files. Floating tensors are cast shard by shard, so at most one shard's cast copy is held.
    `metadata` goes into every safetensors header beside {"format": "pt"} (a checkpoint's step and run).
    `staged=False` writes straight into `path`, a fresh folder of the caller's own (sltune.training.checkpoints's unit).
    A file that cannot be written (a full disk) is an OSError naming it."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if staged:          # what a killed save left here is removed by the next run that locks the folder
        staging = path / f".sltune-tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    else:
        staging = path

    def saved(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()

    shapes = {k: torch.empty(v.shape, dtype=dtype if v.is_floating_point() else v.dtype, device="meta")
              for k, v in state.items()}
    split = split_torch_state_dict_into_shards(shapes, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    try:
        for file, names in split.filename_to_tensors.items():
            with _naming(staging / file):
                save_file({n: saved(state[n]) for n in names}, staging / file,
                          metadata={"format": "pt", **(metadata or {})})
        if split.is_sharded:
            with _naming(staging / INDEX):
                (staging / INDEX).write_text(json.dumps({"metadata": split.metadata,
                                                         "weight_map": split.tensor_to_filename},
                                                        indent=2, sort_keys=True) + "\n")
        config = copy.deepcopy(model.config)
        config.dtype = dtype
        with _naming(staging / "config.json"):
            config.save_pretrained(staging)
        generation = getattr(model, "generation_config", None)
        if generation is not None and model.can_generate():
            with _naming(staging / "generation_config.json"):
                generation.save_pretrained(staging)
        if source is not None and Path(source).resolve() != path.resolve():
            for name, data in read_tokenizer_files(source).items():
                with _naming(staging / name):
                    (staging / name).write_bytes(data)
    except BaseException:
        if staged:
            shutil.rmtree(staging, ignore_errors=True)     # a full disk is not kept full by the half-written copy
        raise
    if staged:
        for item in staging.iterdir():
            os.replace(item, path / item.name)
        staging.rmdir()
    weights = set(split.filename_to_tensors) | ({INDEX} if split.is_sharded else set())
    for stale in [*path.glob("model*.safetensors"), path / INDEX]:     # a previous save's other layout
        if stale.name not in weights and stale.is_file():
            stale.unlink()
    return [path / f for f in split.filename_to_tensors]


@contextlib.contextmanager
def _naming(file: Path) -> Iterator[None]:
    """An error writing `file` (safetensors' 'I/O error: No space left on device', an OSError without a name) as an
    OSError that names it."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno or errno.EIO, err.strerror or str(err), str(file)) from err
    except SafetensorError as err:      # 'I/O error: No space left on device'; anything else is a bug, as it is
        raise OSError(errno.EIO, " ".join(str(err).split()), str(file)) from err


def read_tokenizer_files(folder: str | Path | None) -> dict[str, bytes]:
    """The tokenizer files in `folder` (none for None), read into memory: a training run holds them from its start,
    so every folder it saves gets them even once the folder they came from is pruned or overwritten."""
    if folder is None:
        return {}
    return {name: confined.read_bytes(Path(folder) / name) for name in TOKENIZER_FILES
            if (Path(folder) / name).is_file()}


def write_tokenizer_files(folder: str | Path, files: dict[str, bytes]) -> None:
    """Write a tokenizer's files into a saved model folder, each under a temporary name renamed into place, and
    remove the tokenizer files of another tokenizer left there, so the folder holds one tokenizer, whole. No files:
    the folder is left as it is."""
    if not files:
        return
    folder = Path(folder)
    for name, data in files.items():
        tmp = folder / f".{name}.sltune-tmp-{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, folder / name)
    for name in set(TOKENIZER_FILES) - set(files):
        (folder / name).unlink(missing_ok=True)


def untied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (model's state_dict) with a tied weight once, under its first name, as transformers saves it: what
    SpeedLoader's engine and a wrapped backend's training both write to a Hugging Face folder."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen: set[int] = set()
    out = {}
    for name, value in state.items():
        key = id(params[name]) if name in params else id(value)
        if key not in seen:
            seen.add(key)
            out[name] = value
    return out
