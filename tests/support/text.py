"""A tiny byte-level BPE tokenizer trained here (nothing is downloaded) and the documents it is trained on,
shared by the text-data tests, and `tok_dir`, a module's fixture holding it."""

from __future__ import annotations

from pathlib import Path

import pytest

DOCS = ["the quick brown fox jumps over the lazy dog", "héllo wörld,\n\nsecond paragraph of the same document",
        "", "  leading spaces and trailing ones  ", "the end"]


def save_tokenizer(folder: Path, eos: str | None = "<eos>") -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 3 + ["a fox and a dog", "paragraphs of documents"], trainer)
    kwargs = {"eos_token": eos} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **kwargs).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok"))
