"""Preset shapes: tiny ones that run in seconds on a CPU, benchmark sizes, and real shapes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sltune.models import confined

if TYPE_CHECKING:       # torch loads when a model is built: the spec reads presets without it
    import torch

SUPPORTED_FAMILIES = ("gpt2", "llama", "mistral", "opt", "qwen2")

# Small token ids so tiny vocabularies stay valid; no dropout so sub-batched and whole-batch
# training are comparable bit for bit in tests.
_TINY = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "max_position_embeddings": 512}


@dataclass(frozen=True)
class Preset:
    family: str
    description: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(self.family, **self.kwargs)


def _llama(v, h, i, layers, heads, kv=None, **extra):
    return dict(vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv or heads, **extra)


PRESETS: dict[str, Preset] = {
    # tiny: every family, seconds on a CPU; the test suite's models
    "llama-tiny": Preset("llama", "4 layers, hidden 64: seconds on a CPU", _llama(512, 64, 176, 4, 4, 2, **_TINY)),
    "llama-tiny-tied": Preset("llama", "llama-tiny with tied input/output embeddings",
                              _llama(512, 64, 176, 4, 4, 2, tie_word_embeddings=True, **_TINY)),
    "mistral-tiny": Preset("mistral", "4 layers, sliding window 16",
                           _llama(512, 64, 176, 4, 4, 2, sliding_window=16, **_TINY)),
    "qwen2-tiny": Preset("qwen2", "4 layers, attention biases, 2 sliding-window layers",
                         _llama(512, 64, 176, 4, 4, 2, use_sliding_window=True, sliding_window=16,
                                max_window_layers=2, **_TINY)),
    "gpt2-tiny": Preset("gpt2", "4 layers, learned positions, tied embeddings",
                        dict(vocab_size=512, n_embd=64, n_layer=4, n_head=4, n_positions=512, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)),
    "opt-tiny": Preset("opt", "4 layers, project_in/out (word_embed_proj_dim 32), tied embeddings",
                       dict(vocab_size=512, hidden_size=64, ffn_dim=176, num_hidden_layers=4, num_attention_heads=4,
                            word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, **_TINY)),
    # benchmark sizes
    "llama-small": Preset("llama", "~34M parameters: the runtime benchmark's model",
                          _llama(8192, 512, 1408, 8, 8, max_position_embeddings=2048,
                                 **{k: v for k, v in _TINY.items() if k != "max_position_embeddings"})),
    "llama-medium": Preset("llama", "~134M parameters",
                           _llama(32000, 768, 2048, 12, 12, max_position_embeddings=2048)),
    # real shapes, for machines that can hold them
    "llama-2-7b": Preset("llama", "Llama-2-7B shape",
                         _llama(32000, 4096, 11008, 32, 32, max_position_embeddings=4096)),
    "llama-2-13b": Preset("llama", "Llama-2-13B shape",
                          _llama(32000, 5120, 13824, 40, 40, max_position_embeddings=4096)),
    "llama-2-70b": Preset("llama", "Llama-2-70B shape",
                          _llama(32000, 8192, 28672, 80, 64, 8, max_position_embeddings=4096)),
    "mistral-7b": Preset("mistral", "Mistral-7B-v0.1 shape",
                         _llama(32000, 4096, 14336, 32, 32, 8, sliding_window=4096, max_position_embeddings=32768)),
    "qwen2-0.5b": Preset("qwen2", "Qwen2-0.5B shape", _llama(151936, 896, 4864, 24, 14, 2, tie_word_embeddings=True)),
    "qwen2-1.5b": Preset("qwen2", "Qwen2-1.5B shape", _llama(151936, 1536, 8960, 28, 12, 2, tie_word_embeddings=True)),
    "qwen2-7b": Preset("qwen2", "Qwen2-7B shape", _llama(152064, 3584, 18944, 28, 28, 4)),
    "gpt2": Preset("gpt2", "GPT-2 124M shape", {}),
    "gpt2-medium": Preset("gpt2", "GPT-2 355M shape", dict(n_embd=1024, n_layer=24, n_head=16)),
    "opt-125m": Preset("opt", "OPT-125M shape", dict(hidden_size=768, ffn_dim=3072, num_hidden_layers=12,
                                                   num_attention_heads=12, word_embed_proj_dim=768)),
    "opt-1.3b": Preset("opt", "OPT-1.3B shape", dict(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24,
                                                   num_attention_heads=32, word_embed_proj_dim=2048)),
    "opt-6.7b": Preset("opt", "OPT-6.7B shape", dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                                                   num_attention_heads=32, word_embed_proj_dim=4096)),
}


def load_config(model: Any, source: str | None = None):
    """A transformers config from a preset name, a path to a config.json (or its folder), a dict, or a config.

    Only the families sltune supports are accepted, and no remote code is ever run. The file
    save_pretrained writes is accepted as it is: its metadata (METADATA_KEYS) is dropped. `source` names
    the dict or file in error messages (default: "hf_config", or the file's path).
    """
    from transformers import PretrainedConfig

    if isinstance(model, PretrainedConfig):
        config = model
    elif isinstance(model, dict):
        config = _from_dict(model, source or "hf_config")
    elif isinstance(model, str) and model in PRESETS:
        config = PRESETS[model].config()
    else:
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"{source + ': ' if source else f'model {model!r} is '}neither a preset nor a config.json file; "
                f"presets: {', '.join(PRESETS)}"
            )
        source = source or str(path)
        try:
            raw = confined.read_bytes(path)     # inside the server's models_dir, when a job's folder is read
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"{source}: {_binary(raw)}, not a model config; give a preset ({', '.join(PRESETS)}), "
                             "a transformers config.json or a Hugging Face model folder (config.json and "
                             "model.safetensors, as `sltune train --save DIR` writes)") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}: not valid JSON ({err})") from None
        except RecursionError:
            raise ValueError(f"{source}: nested deeper than any model config (about 1,000 levels stops the "
                             "reader); give the config.json save_pretrained writes") from None
        except OSError as err:
            raise ValueError(f"{source}: cannot be read ({err.strerror or type(err).__name__})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object (a transformers config.json), got "
                             f"{type(data).__name__}")
        config = _from_dict(data, source)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model family {config.model_type!r} is not supported; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return config


def _binary(data: bytes) -> str:
    """What a file that is not text probably is: torch.save writes a zip archive (or, before torch 1.6 and
    with _use_new_zipfile_serialization=False, a pickle)."""
    if data.startswith(b"PK\x03\x04") or data[:1] == b"\x80":
        return "a PyTorch checkpoint (torch.save: a zip or pickle of tensors)"
    return "a binary file"


# Sizes beyond any real model: a config above them is refused before anything is built from it.
_BOUNDS = {"num_hidden_layers": 1024, "n_layer": 1024, "hidden_size": 65536, "n_embd": 65536,
           "intermediate_size": 262144, "ffn_dim": 262144, "n_inner": 262144, "vocab_size": 1_048_576,
           "num_attention_heads": 1024, "n_head": 1024, "num_key_value_heads": 1024,
           "max_position_embeddings": 1_048_576, "n_positions": 1_048_576, "word_embed_proj_dim": 65536,
           "head_dim": 65536}
# ...and together: keys each within their bound can still multiply into any size, so the whole model is
# bounded too, by its parameters as the config implies them (about 2x the largest open models).
MAX_PARAMS = 2 * 10**12


# keys through which a config can pull in code, kernels or quantizers from outside transformers itself
_CODE_KEYS = {"auto_map", "trust_remote_code", "attn_implementation", "quantization_config", "use_kernels",
              "kernel_config", "custom_pipelines", "name_or_path"}
# what transformers' save_pretrained writes about the file rather than the model: which version wrote it,
# where it came from, the class that saved it and the dtype of the weights beside it. Metadata, not code:
# accepted and dropped (sltune builds the family's standard class, in the dtype the config or flags give).
METADATA_KEYS = ("transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype")
# private fields a family's own config class declares (OPT's save_pretrained writes _remove_final_layer_norm):
# the family's standard options, accepted as any other field of its config
FAMILY_PRIVATE_KEYS = {"opt": ("_remove_final_layer_norm",)}


def hf_config_schema() -> dict[str, Any]:
    """The JSON schema of an inline config as _from_dict checks it, for the API's OpenAPI document."""
    sizes = {key: {"type": "integer", "minimum": 1, "maximum": bound} for key, bound in _BOUNDS.items()}
    allowed = [k for k in METADATA_KEYS if k.startswith("_")] + [k for ks in FAMILY_PRIVATE_KEYS.values() for k in ks]
    private = {"allOf": [{"pattern": "^_"}, {"not": {"enum": allowed}}]}
    return {"type": "object", "required": ["model_type"],
            "properties": {"model_type": {"enum": list(SUPPORTED_FAMILIES)}, **sizes},
            "propertyNames": {"not": {"anyOf": [{"enum": sorted(_CODE_KEYS)}, private]}}}


def _from_dict(data: dict[str, Any], source: str):
    from transformers import AutoConfig

    data = {key: value for key, value in data.items() if key not in METADATA_KEYS}
    for key, bound in _BOUNDS.items():
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():      # 12.0 is JSON's integer 12 too
            value = data[key] = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise ValueError(f"{source}: {key} must be an integer from 1 to {bound}, got {value!r}")
    family = data.pop("model_type", None)
    if family is None:
        raise ValueError(f"{source}: no 'model_type'; set it to one of {', '.join(SUPPORTED_FAMILIES)}")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"{source}: model family {family!r} is not supported; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    for key in data:
        if key in _CODE_KEYS or (key.startswith("_") and key not in FAMILY_PRIVATE_KEYS.get(family, ())):
            raise ValueError(f"{source}: '{key}' is not accepted: it can load code or kernels from outside; "
                             "sltune builds the standard families with their standard attention")
    try:
        config = AutoConfig.for_model(family, **data)
    except Exception as err:  # noqa: BLE001 - any rejection is the config's fault, reported as such
        raise ValueError(f"{source}: transformers rejected the config: {type(err).__name__}: {err}") from None
    params = implied_params(config)
    if params > MAX_PARAMS:
        raise ValueError(f"{source}: these sizes make a model of about {params:.3g} parameters, more than the "
                         f"{MAX_PARAMS:.0e} sltune accepts; lower num_hidden_layers, hidden_size, "
                         "intermediate_size, head_dim or vocab_size")
    return config


def implied_params(config) -> int:
    """Parameters a config implies, from its sizes alone (nothing built): at least the real count, since
    it counts gated MLPs, biases and untied embeddings whether the family has them or not."""
    h = config.hidden_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    inner = (getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
             or getattr(config, "n_inner", None) or 4 * h)
    width = max(h, getattr(config, "word_embed_proj_dim", None) or h)
    layer = (h + 1) * head_dim * 2 * (heads + kv) + 3 * h * inner + 2 * inner + 4 * h    # + biases, norms
    positions = (getattr(config, "max_position_embeddings", 0) or 0) if config.model_type in ("gpt2", "opt") else 0
    return config.num_hidden_layers * layer + 2 * config.vocab_size * width + positions * width


def with_layers(config: Any, layers: int):
    """A copy of `config` with `layers` decoder layers and every width unchanged: the tuner's reduced-depth probes.
    A family whose layers differ by type (Qwen2's sliding-window ones, `layer_types`) keeps an even sample of
    them, so the probe runs the same mix of layers as the whole model."""
    import copy

    out = copy.deepcopy(config)
    types = getattr(config, "layer_types", None)
    out.num_hidden_layers = layers          # GPT-2's n_layer, through the config's attribute_map
    if types:
        out.layer_types = [types[i * len(types) // layers] for i in range(layers)]
    return out


def build(model: Any = "llama-tiny", seed: int = 0, dtype: str | torch.dtype = "float32"):
    """A causal LM with seeded random weights from a preset, a config.json path, a dict or a config."""
    import torch
    from transformers import AutoModelForCausalLM

    config = load_config(model)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch_dtype)


def param_count(model: Any) -> int:
    """Parameters of a preset or config, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = load_config(model)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())
