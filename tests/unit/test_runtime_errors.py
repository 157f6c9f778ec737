"""Bad input fails early with a message that says what to change."""

import warnings

import pytest
import torch
from transformers import BertConfig, BertLMHeadModel

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.models import build
from tests.support.reference import adamw


def engine(**knobs):
    return SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(**knobs), optimizer=adamw)


def test_batch_rows_must_be_b_times_n():
    with pytest.raises(ValueError, match=r"6 rows but sub_batch_size\*num_sub_batches = 2\*4 = 8"):
        engine(sub_batch_size=2, num_sub_batches=4).train_step(torch.zeros(6, 8, dtype=torch.long))


@pytest.mark.parametrize("field", ["sub_batch_size", "num_sub_batches", "num_live_blocks"])
def test_knobs_below_one_name_the_field(field):
    with pytest.raises(ValueError, match=field):
        SpeedLoaderConfig(**{field: 0})


def test_unsupported_family_names_the_supported_ones():
    model = BertLMHeadModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, is_decoder=True))
    with pytest.raises(ValueError, match="'bert'.*supported families: gpt2, llama, mistral, opt, qwen2"):
        SpeedLoaderEngine(model, SpeedLoaderConfig(), optimizer=adamw)


def test_a_config_of_another_backend_is_not_run_as_speedloader():
    """A best.yaml that DeepSpeed or FSDP won names its backend: the engine refuses it rather than train it as its
    own schedule."""
    with pytest.raises(ValueError, match="backend 'fsdp': this engine is SpeedLoader's; .*sltune train --config"):
        engine(backend="fsdp")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it():
    with pytest.raises(ValueError, match="not available.*use device='cpu'"):
        engine(device="cuda")


def test_unknown_dtype_and_device():
    with pytest.raises(ValueError, match="dtype"):
        SpeedLoaderConfig(dtype="float8")
    with pytest.raises(ValueError, match="not a torch device"):
        SpeedLoaderConfig(device="gpu0")


def test_generate_only_engine_refuses_to_train():
    eng = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(), optimizer=None)
    with pytest.raises(ValueError, match="optimizer=None"):
        eng.train_step(torch.zeros(1, 8, dtype=torch.long))


def test_token_ids_and_lengths_are_checked():
    eng = engine()
    with pytest.raises(ValueError, match=r"token ids in \[0, 512\)"):
        eng.train_step(torch.full((1, 8), 600))
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        eng.train_step(torch.zeros(1, 600, dtype=torch.long))
    with pytest.raises(ValueError, match="2-D LongTensor"):
        eng.train_step(torch.zeros(8))


def test_optimizer_factory_must_return_an_optimizer():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(), optimizer=lambda ps: None)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_trains_on_cpu(dtype):
    # float16 keeps AdamW's state in float16 too (as model.half() would): eps=1e-8 is 0 there, so 1e-4
    eng = SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(dtype=dtype, sub_batch_size=2,
                            num_sub_batches=2), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, eps=1e-4))
    ids = torch.randint(3, 512, (4, 8), generator=torch.Generator().manual_seed(0))
    losses = [eng.train_step(ids).loss for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5, losses           # it learns the batch
    assert all(p.dtype == getattr(torch, dtype) for p in eng.model.parameters())


def test_an_optimizer_eps_that_vanishes_in_float16_is_flagged():
    """Only where the optimizer steps float16 itself: a float32 master keeps eps=1e-8 as it is."""
    with pytest.warns(UserWarning, match="eps=1e-08 is 0 in float16"):
        SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(dtype="float16", mixed_precision=False),
                          optimizer=lambda ps: torch.optim.AdamW(ps))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeedLoaderEngine(build("llama-tiny"), SpeedLoaderConfig(dtype="float16"),
                          optimizer=lambda ps: torch.optim.AdamW(ps))


def test_labels_and_masks_are_checked():
    eng = engine(sub_batch_size=1, num_sub_batches=2)
    ids = torch.randint(3, 512, (2, 8))
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 512\) or -100"):
        eng.train_step(ids, labels=torch.full_like(ids, 700))
    with pytest.raises(ValueError, match="every next-token label is -100"):
        eng.train_step(ids, labels=torch.full_like(ids, -100))
    with pytest.raises(ValueError, match="attention_mask must hold 0"):
        eng.train_step(ids, attention_mask=torch.full_like(ids, 2))
    with pytest.raises(ValueError, match=r"got a 1-D torch.int64 tensor of shape \(8,\)"):
        eng.train_step(torch.zeros(8, dtype=torch.long))
