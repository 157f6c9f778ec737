"""How sltune calls a causal LM by its parts (sltune.runtime.family): a family it cannot call is refused naming the
ones it can."""

import pytest
from transformers import BertConfig, BertLMHeadModel

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from tests.support.reference import adamw


def test_unsupported_family_names_the_supported_ones():
    model = BertLMHeadModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, is_decoder=True))
    with pytest.raises(ValueError, match="'bert'.*supported families: gpt2, llama, mistral, opt, qwen2"):
        SpeedLoaderEngine(model, SpeedLoaderConfig(), optimizer=adamw)
