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
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# what a tokenizer (and chat template) saved beside a model is made of: copied with the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class Checkpoint:
    """A Hugging Face model folder: its config and where each tensor lives."""

    def __init__(self, path: str | Path):
        from sltune.models.presets import load_config

        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"--model {path}: not a folder; give a Hugging Face model folder (config.json and "
                             "model.safetensors), a config.json or a preset name")
        self.config = load_config(self.path)
        self.files: dict[str, Path] = {}
        index, single = self.path / INDEX, self.path / WEIGHTS
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{index}: not a safetensors index with a weight_map ({err})") from None
            self.files = {name: self.path / file for name, file in weight_map.items()}
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
        from safetensors import safe_open

        for name, file in self.files.items():
            with safe_open(file, framework="pt") as f:
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
        from safetensors import safe_open

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
        state = {"file": None, "handle": None}

        def fill(p: nn.Parameter, dst: torch.Tensor) -> None:
            name = chosen[id(p)]
            file = self.files[name]
            if state["file"] != file:
                close()
                state["handle"] = safe_open(file, framework="pt").__enter__()
                state["file"] = file
            tensor = state["handle"].get_tensor(name)
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(f"{file}: {name} has shape {tuple(tensor.shape)} but config.json makes it "
                                 f"{tuple(p.shape)}; the weights and the config are of different models")
            dst.copy_(tensor)

        def close() -> None:
            if state["handle"] is not None:
                state["handle"].__exit__(None, None, None)
            state["file"] = state["handle"] = None

        try:
            yield fill
        finally:
            close()


def _keys(file: Path) -> list[str]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from None


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
                     max_shard_size: int | str = "5GB", source: Path | None = None) -> list[Path]:
    """Write `state` (each tensor once: tied names already dropped) as a Hugging Face folder in `dtype`; returns
    the weight files. Floating tensors are cast shard by shard, so at most one shard's cast copy is held."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    staging = path / f".sltune-tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()

    def saved(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()

    shapes = {k: torch.empty(v.shape, dtype=dtype if v.is_floating_point() else v.dtype, device="meta")
              for k, v in state.items()}
    split = split_torch_state_dict_into_shards(shapes, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for file, names in split.filename_to_tensors.items():
        save_file({n: saved(state[n]) for n in names}, staging / file, metadata={"format": "pt"})
    if split.is_sharded:
        (staging / INDEX).write_text(json.dumps({"metadata": split.metadata, "weight_map": split.tensor_to_filename},
                                                indent=2, sort_keys=True) + "\n")
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(staging)
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(staging)
    if source is not None and Path(source).resolve() != path.resolve():
        for name, data in read_tokenizer_files(source).items():
            (staging / name).write_bytes(data)
    for item in staging.iterdir():
        os.replace(item, path / item.name)
    staging.rmdir()
    weights = set(split.filename_to_tensors) | ({INDEX} if split.is_sharded else set())
    for stale in [*path.glob("model*.safetensors"), path / INDEX]:     # a previous save's other layout
        if stale.name not in weights and stale.is_file():
            stale.unlink()
    return [path / f for f in split.filename_to_tensors]


def read_tokenizer_files(folder: str | Path | None) -> dict[str, bytes]:
    """The tokenizer files in `folder` (none for None), read into memory: a training run holds them from its start,
    so every folder it saves gets them even once the folder they came from is pruned or overwritten."""
    if folder is None:
        return {}
    return {name: (Path(folder) / name).read_bytes() for name in TOKENIZER_FILES if (Path(folder) / name).is_file()}


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
