"""Text data for `sltune train` (sltune.training.text): .txt/.jsonl/.parquet tokenized into the ids the tokenizer
itself gives, cached beside the data; a document that is one long line is tokenized in bounded pieces (a 50 MB single
line took 7.8 GB whole; bench/text_memory.py), cut where the tokenizer starts a word anyway, so the ids equal those
of the whole line.

The tokenizer is a tiny byte-level BPE trained here and saved with save_pretrained: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from sltune.training import text
from sltune.training.data import load_tokens
from sltune.training.text import cache_path, load_tokenizer, tokenize_documents, tokenize_file
from tests.support.text import DOCS, save_tokenizer
from tests.support.text import tok_dir  # noqa: F401 - a fixture its tests ask for by name


def _expected(tok_dir: Path, docs: list[str]) -> list[int]:
    tok = load_tokenizer(tok_dir)
    return [i for d in docs for i in [*tok.encode(d, add_special_tokens=False), tok.eos_token_id]]


def _jsonl(path: Path, docs: list[str]) -> Path:
    lines = [json.dumps({"text": d, "id": n}) for n, d in enumerate(docs)]
    path.write_text("\n".join(lines[:2]) + "\n\n   \n" + "\n".join(lines[2:]) + "\n", encoding="utf-8")
    return path


# -- text files ------------------------------------------------------------------------------------
def test_txt_is_one_document_followed_by_eos(tmp_path, tok_dir):
    text = "\n".join(DOCS)
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    ids = load_tokens(tmp_path / "corpus.txt", tok_dir)
    assert ids.dtype == torch.long and ids.tolist() == _expected(tok_dir, [text])
    assert ids[-1] == load_tokenizer(tok_dir).eos_token_id


def test_jsonl_and_parquet_give_each_document_then_eos(tmp_path, tok_dir):
    from_jsonl = load_tokens(_jsonl(tmp_path / "docs.jsonl", DOCS), tok_dir)
    pd.DataFrame({"id": range(len(DOCS)), "text": DOCS}).to_parquet(tmp_path / "docs.parquet")
    from_parquet = load_tokens(tmp_path / "docs.parquet", tok_dir)
    expected = _expected(tok_dir, DOCS)
    assert from_jsonl.tolist() == expected
    assert torch.equal(from_jsonl, from_parquet)
    eos = load_tokenizer(tok_dir).eos_token_id
    assert (from_jsonl == eos).sum() == len(DOCS)       # no special token but the separators


# -- the cache -------------------------------------------------------------------------------------
def test_cache_is_written_then_read_and_keyed_on_data_and_tokenizer(tmp_path, tok_dir):
    data = _jsonl(tmp_path / "docs.jsonl", DOCS)
    first = tokenize_file(data, tok_dir)
    cache = cache_path(data, tok_dir)
    assert not first.from_cache and first.cache == cache and cache.is_file()
    assert cache.name.startswith("docs.jsonl.sltune-") and len(cache.name) == len("docs.jsonl.sltune-.npy") + 16
    assert np.load(cache).dtype == np.int32 and list(tmp_path.glob("*.tmp")) == []
    second = tokenize_file(data, tok_dir)
    assert second.from_cache and np.array_equal(first.ids, second.ids)
    # proof without mocks that a load reads the cache: ids planted in it come back
    np.save(cache, np.array([7, 8, 9], dtype=np.int32))
    assert load_tokens(data, tok_dir).tolist() == [7, 8, 9]

    _jsonl(data, DOCS[:2])                                   # changed data: a new key, tokenized afresh
    changed = tokenize_file(data, tok_dir)
    assert not changed.from_cache and changed.cache != cache
    assert changed.ids.tolist() == _expected(tok_dir, DOCS[:2])

    other_tok = shutil.copytree(tok_dir, tmp_path / "tok2")  # a changed tokenizer file: a new key too
    config = json.loads((other_tok / "tokenizer_config.json").read_text())
    (other_tok / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    retok = tokenize_file(data, other_tok)
    assert not retok.from_cache and retok.cache not in (cache, changed.cache)
    assert tokenize_file(data, tok_dir).from_cache            # the first tokenizer's cache is still good


def test_unwritable_cache_warns_once_and_still_tokenizes(tmp_path, tok_dir):
    data = _jsonl(tmp_path / "docs.jsonl", DOCS)
    cache_path(data, tok_dir).mkdir()           # something os.replace can't overwrite, even as root
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [tokenize_file(data, tok_dir) for _ in range(2)]
    assert [r.ids.tolist() for r in results] == [_expected(tok_dir, DOCS)] * 2
    assert all(r.cache is None and not r.from_cache for r in results)
    assert len([w for w in caught if "cannot cache" in str(w.message)]) == 1
    assert list(tmp_path.glob("*.tmp")) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes to read-only folders")
def test_read_only_folder_goes_on_without_a_cache(tmp_path, tok_dir):
    folder = tmp_path / "ro"
    folder.mkdir()
    data = _jsonl(folder / "docs.jsonl", DOCS)
    folder.chmod(0o555)
    try:
        with pytest.warns(UserWarning, match="cannot cache"):
            assert load_tokens(data, tok_dir).tolist() == _expected(tok_dir, DOCS)
    finally:
        folder.chmod(0o755)


# -- errors name the fix ---------------------------------------------------------------------------
def test_bad_jsonl_lines_are_reported_with_their_number(tmp_path, tok_dir):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r'docs.jsonl line 3: no string "text" field'):
        load_tokens(path, tok_dir)
    path.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ValueError, match="line 2: not JSON"):
        load_tokens(path, tok_dir)


def test_parquet_without_a_text_column_lists_the_columns(tmp_path, tok_dir):
    pd.DataFrame({"body": ["a", "b"]}).to_parquet(tmp_path / "docs.parquet")
    with pytest.raises(ValueError, match="no 'text' column \\(columns: body"):
        load_tokens(tmp_path / "docs.parquet", tok_dir)


def test_tokenizer_without_eos_or_folder_is_refused(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello")
    no_eos = save_tokenizer(tmp_path / "no_eos", eos=None)
    with pytest.raises(ValueError, match="--tokenizer .*no_eos: the tokenizer has no eos_token.*set one"):
        load_tokens(tmp_path / "corpus.txt", no_eos)
    with pytest.raises(ValueError, match="--tokenizer .*missing: no such folder"):
        load_tokens(tmp_path / "corpus.txt", tmp_path / "missing")


# -- long lines ----------------------------------------------------------------------------------------
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
