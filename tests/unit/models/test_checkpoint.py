"""Hugging Face folders in and out: weights read straight into the engine from (sharded) safetensors, trained, and
written back as a folder transformers loads with equal logits."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from sltune.training import OptimizerConfig


def save_gqa_checkpoint(path, dtype=torch.bfloat16, shard="200KB"):
    """llama-tiny (4 query heads over 2 key/value heads: GQA), saved as transformers saves it."""
    model = build("llama-tiny", seed=3).to(dtype)
    model.save_pretrained(path, max_shard_size=shard)
    return model


def batch(rows=4, seq=16):
    return torch.randint(3, 512, (rows, seq), generator=torch.Generator().manual_seed(7))


def test_train_from_a_sharded_bfloat16_checkpoint_and_save_a_folder_transformers_loads(tmp_path):
    source = tmp_path / "src"
    save_gqa_checkpoint(source)
    assert (source / "model.safetensors.index.json").is_file()             # sharded, with an index
    config = json.loads((source / "config.json").read_text())
    assert {"transformers_version", "architectures"} <= set(config)         # accepted as transformers wrote it
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    x = batch()
    with torch.no_grad():
        expected = hf(input_ids=x, labels=x).loss.item()

    engine = SpeedLoaderEngine.from_pretrained(source, SpeedLoaderConfig(dtype="bfloat16", sub_batch_size=4),
                                               optimizer=OptimizerConfig(lr=1e-3).factory)
    for name, value in hf.state_dict().items():       # the weights arrived, bit for bit
        assert torch.equal(engine.state_dict()[name].to(torch.bfloat16), value), name
    first = engine.train_step(x)
    assert first.loss == pytest.approx(expected, rel=1e-6)
    engine.train_step(x)

    out = tmp_path / "out"
    files = engine.save_pretrained(out, max_shard_size="300KB")
    assert len(files) > 1 and (out / "model.safetensors.index.json").is_file()
    saved = json.loads((out / "config.json").read_text())
    assert saved["dtype"] == "bfloat16"                                     # the source checkpoint's dtype
    trained = AutoModelForCausalLM.from_pretrained(out)
    assert trained.dtype == torch.bfloat16
    with torch.no_grad():
        ours = engine.model(input_ids=x).logits
        theirs = trained(input_ids=x).logits
    assert torch.equal(ours, theirs)
    assert not torch.equal(theirs, hf(input_ids=x).logits)                 # and they did train


def test_tied_weights_are_saved_once_and_float32_saves_the_masters(tmp_path):
    model = build("llama-tiny-tied", seed=0)
    engine = SpeedLoaderEngine(model, SpeedLoaderConfig(dtype="bfloat16", sub_batch_size=2, num_sub_batches=2),
                               optimizer=OptimizerConfig().factory)
    engine.train_step(batch())
    engine.save_pretrained(tmp_path / "out")                # no source checkpoint: the float32 masters
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.dtype == torch.float32
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    masters = engine.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, masters[name]), name


def test_the_tokenizer_files_travel_with_the_weights(tmp_path):
    source = tmp_path / "src"
    save_gqa_checkpoint(source, shard="10MB")
    (source / "tokenizer.json").write_text("{}")
    (source / "tokenizer_config.json").write_text("{}")
    engine = SpeedLoaderEngine.from_pretrained(source, SpeedLoaderConfig(dtype="bfloat16"), optimizer=None)
    engine.save_pretrained(tmp_path / "out", dtype="float32")
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_bad_folders_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        SpeedLoaderEngine.from_pretrained(tmp_path / "nope", SpeedLoaderConfig())
    source = tmp_path / "src"
    save_gqa_checkpoint(source, shard="10MB")
    other = tmp_path / "other"
    build({"model_type": "llama", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}).save_pretrained(other)
    (source / "model.safetensors").replace(tmp_path / "keep.safetensors")
    (other / "model.safetensors").replace(source / "model.safetensors")
    with pytest.raises(ValueError, match="has shape .* different models"):
        SpeedLoaderEngine.from_pretrained(source, SpeedLoaderConfig())
    (source / "model.safetensors").unlink()
    torch.save({}, source / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        SpeedLoaderEngine.from_pretrained(source, SpeedLoaderConfig())


def test_a_folder_with_only_a_config_gets_seeded_random_weights(tmp_path):
    build("llama-tiny").config.save_pretrained(tmp_path)
    a = SpeedLoaderEngine.from_pretrained(tmp_path, SpeedLoaderConfig(), seed=1).state_dict()
    b = build("llama-tiny", seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "opt-tiny", "qwen2-tiny", "mistral-tiny", "llama-tiny-tied"])
def test_every_family_trains_from_and_saves_to_a_folder_transformers_wrote(tmp_path, preset):
    """config.json as each family's save_pretrained writes it (OPT's private _remove_final_layer_norm too); the
    saved masters are what transformers loads back."""
    build(preset, seed=1).save_pretrained(tmp_path / "src")
    engine = SpeedLoaderEngine.from_pretrained(tmp_path / "src", SpeedLoaderConfig(dtype="bfloat16", sub_batch_size=2,
                                               num_sub_batches=2), optimizer=OptimizerConfig().factory)
    engine.train_step(batch())
    engine.save_pretrained(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ours = engine.state_dict()
    assert loaded.dtype == torch.float32                    # the source's dtype
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, ours[name]), name
