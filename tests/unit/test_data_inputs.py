"""--data files that are not what they claim, and text that is one long line (issue 31, item 9 and M5).

A token file that is not one (a fake .npy, a torn .pt, an odd-sized .bin) is one line naming the file; float ids are
refused, not trained on; narrow signed ids (int8, int16) are read with a warning, once per file. A text document
is tokenized in bounded pieces (a 50 MB single line took 7.8 GB whole; bench/text_memory.py), cut where the
tokenizer starts a word anyway, so the ids equal those of the whole line.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from sltune.training.data import load_tokens
from sltune.training import text
from sltune.training.text import load_tokenizer, tokenize_documents, tokenize_file
from tests.support.text import DOCS, save_tokenizer


# -- token files ---------------------------------------------------------------------------------------
def test_a_fake_npy_or_pt_is_one_line_naming_the_file(tmp_path):
    for name in ("fake.npy", "fake.pt"):
        (tmp_path / name).write_bytes(b"these are not token ids\n" * 10)
        with pytest.raises(ValueError) as err:
            load_tokens(tmp_path / name)
        msg = str(err.value)
        assert msg.startswith(f"--data {tmp_path / name}: not a ") and "\n" not in msg, msg
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match=r"objects.npy: not a NumPy .npy file of token ids \(it holds pickled Python"):
        load_tokens(tmp_path / "objects.npy")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match=r"--data .*odd.bin: 3 bytes, an odd count"):
        load_tokens(tmp_path / "odd.bin")


@pytest.mark.parametrize("suffix", [".npy", ".pt"])
def test_float_ids_are_refused_naming_the_file_and_the_fix(tmp_path, suffix):
    path = tmp_path / f"ids{suffix}"
    values = np.random.default_rng(0).random(100) * 500
    if suffix == ".npy":
        np.save(path, values)
        fix = "np.save(path, ids.astype(np.int32))"
    else:
        torch.save(torch.from_numpy(values).float(), path)
        fix = "torch.save(ids.to(torch.int32), path)"
    with pytest.raises(ValueError) as err:
        load_tokens(path)                       # before: cast to int64 and trained on silently
    msg = str(err.value)
    assert msg.startswith(f"--data {path}: holds float") and "token ids are integers" in msg and fix in msg, msg


def test_int16_ids_are_read_with_one_warning_naming_the_file(tmp_path):
    path = tmp_path / "ids16.npy"
    np.save(path, np.arange(100, dtype=np.int16))
    np.save(tmp_path / "ids_u16.npy", np.arange(100, dtype=np.uint16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert load_tokens(path).tolist() == list(range(100))
        assert load_tokens(tmp_path / "ids_u16.npy").tolist() == list(range(100))
    said = [str(w.message) for w in caught if "int16" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"--data {path}: int16 token ids, read as int64"), said
    assert not [w for w in caught if "ids_u16" in str(w.message)]


# -- long lines ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


class Spy:
    """A tokenizer that records the length of every text it is called on, per call."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    @property
    def eos_token_id(self) -> int:
        return self.tok.eos_token_id

    def __call__(self, texts, **kwargs):
        self.calls.append([len(t) for t in ([texts] if isinstance(texts, str) else texts)])
        return self.tok(texts, **kwargs)


def _line(chars: int, seed: int = 0) -> str:
    """One line of DOCS's words with their punctuation and accents, some runs of spaces and a few tabs."""
    rng = random.Random(seed)
    words = " ".join(DOCS).split() + ["  ", "\t", "é", "42", "fox."]
    out, n = [], 0
    while n < chars:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars].strip()


@pytest.fixture
def small_pieces(monkeypatch):
    # raising=False: the same tests run against a text.py without pieces, and fail on what they check
    monkeypatch.setattr(text, "_PIECE_CHARS", 2000, raising=False)
    monkeypatch.setattr(text, "_BATCH_CHARS", 8000)
    monkeypatch.setattr(text, "_READ_BYTES", 4096, raising=False)


def test_a_one_line_file_is_tokenized_in_bounded_pieces_with_the_whole_lines_ids(tmp_path, tok_dir, small_pieces,
                                                                                  monkeypatch):
    line = _line(60_000)
    (tmp_path / "oneline.txt").write_text(line, encoding="utf-8")
    tok = load_tokenizer(tok_dir)
    spy = Spy(tok)
    monkeypatch.setattr(text, "load_tokenizer", lambda folder, named=None: spy)
    ids = tokenize_file(tmp_path / "oneline.txt", tok_dir).ids
    assert ids.tolist() == [*tok.encode(line, add_special_tokens=False), tok.eos_token_id]
    assert max(n for call in spy.calls for n in call) <= 2000            # before: one call on the whole line
    assert max(sum(call) for call in spy.calls) <= 8000
    assert sum(len(call) for call in spy.calls) >= 30


def test_long_documents_keep_one_eos_each_and_the_ids_of_the_whole(tmp_path, tok_dir, small_pieces):
    tok = load_tokenizer(tok_dir)
    docs = [_line(9_000, 1), "short", "", _line(4_001, 2), "x" * 4500 + " " + "y" * 100]   # the last: no space early
    spy = Spy(tok)
    ids = tokenize_documents(iter(docs), spy)
    assert max(n for call in spy.calls for n in call) <= 2000
    assert (ids == tok.eos_token_id).sum() == len(docs)
    expected = [i for d in docs[:4] for i in [*tok.encode(d, add_special_tokens=False), tok.eos_token_id]]
    assert ids[:len(expected)].tolist() == expected
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in docs) + "\n", encoding="utf-8")
    assert np.array_equal(tokenize_file(path, tok_dir).ids, ids)


def test_utf8_across_reads_and_the_byte_of_a_bad_one(tmp_path, tok_dir, small_pieces):
    line = ("héllo wörld, 日本語 " * 3000).strip()        # multi-byte characters cross the 4 KiB reads
    (tmp_path / "u.txt").write_text(line, encoding="utf-8")
    tok = load_tokenizer(tok_dir)
    assert tokenize_file(tmp_path / "u.txt", tok_dir).ids.tolist() == [*tok.encode(line, add_special_tokens=False),
                                                                     tok.eos_token_id]
    (tmp_path / "bad.txt").write_bytes(b"ab " * 3000 + "é".encode()[:1] + b" tail")
    with pytest.raises(ValueError, match=r"--data .*bad.txt: not UTF-8 text \(byte 9000\)"):
        tokenize_file(tmp_path / "bad.txt", tok_dir)


def test_a_tokenizer_that_prepends_its_space_marker_gets_pieces_without_the_space(tmp_path, small_pieces):
    """Llama 2's tokenizer.json: no pre-tokenizer, a normalizer that prepends '▁' to every input and makes spaces
    '▁': a piece starting with a space would tokenize as '▁▁word'; the piece without it gives '▁word'."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()       # trained split at spaces, like SentencePiece
    raw.train_from_iterator(DOCS * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"]))
    raw.pre_tokenizer = None
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>").save_pretrained(tmp_path / "t")
    tok = load_tokenizer(tmp_path / "t")
    line = _line(20_000).replace("\t", " ")
    assert text.drops_space(tok)
    assert tokenize_documents([line], tok).tolist() == [*tok.encode(line, add_special_tokens=False), tok.eos_token_id]
