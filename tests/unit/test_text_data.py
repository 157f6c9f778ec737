"""Text data for `sltune train`: .txt/.jsonl/.parquet tokenized into the ids the tokenizer itself gives,
cached beside the data, and a packed, held-out, resumable batch stream over them.

The tokenizer is a tiny byte-level BPE trained here and saved with save_pretrained: nothing is downloaded.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from sltune.training.data import TokenBatches, batches, load_tokens, synthetic_corpus
from sltune.training.text import cache_path, load_tokenizer, tokenize_file
from tests.support.text import DOCS, save_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


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


def test_token_files_still_load_and_ignore_the_tokenizer(tmp_path, tok_dir):
    np.save(tmp_path / "ids.npy", np.arange(10, dtype=np.uint16))
    assert load_tokens(tmp_path / "ids.npy").tolist() == list(range(10))
    assert load_tokens(tmp_path / "ids.npy", tok_dir).tolist() == list(range(10))


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
def test_text_without_a_tokenizer_names_the_flag(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello")
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokens(tmp_path / "corpus.txt")


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


# -- the training stream ---------------------------------------------------------------------------
def _take(stream: TokenBatches, n: int) -> list[torch.Tensor]:
    return list(itertools.islice(stream, n))


@pytest.mark.parametrize("k", [2, 4, 5, 9])      # steps_per_epoch is 4: mid-epoch, at and past the boundary
def test_resume_continues_the_uninterrupted_stream(k):
    tokens = torch.arange(23 * 8 + 5) % 100           # 23 rows of 8 and a dropped tail of 5
    make = lambda: TokenBatches(rows=4, seq_len=8, vocab=100, tokens=tokens, seed=3, holdout=0.2)
    straight = _take(make(), 12)
    first = make()
    assert first.steps_per_epoch == 4 and (first.train_rows, first.eval_rows) == (19, 4)
    _take(first, k)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(straight[k:], _take(resumed, 12 - k)))


def test_epochs_are_fresh_permutations_and_never_touch_the_held_out_rows():
    seq_len, n_rows = 4, 50
    tokens = torch.arange(n_rows * seq_len)           # unique ids: a row is known by its first token
    stream = TokenBatches(rows=6, seq_len=seq_len, vocab=n_rows * seq_len, tokens=tokens, seed=1, holdout=0.1)
    assert (stream.train_rows, stream.eval_rows, stream.steps_per_epoch) == (45, 5, 7)
    epochs = []
    for _ in range(3):
        assert stream.state_dict()["cursor"] == 0
        seen = torch.cat(_take(stream, stream.steps_per_epoch))[:, 0] // seq_len
        assert seen.unique().numel() == seen.numel() == 42      # 3 rows skipped, none repeated
        epochs.append(seen.tolist())
    assert epochs[0] != epochs[1] != epochs[2]
    assert set(itertools.chain(*epochs)) <= set(range(45))
    held = stream.eval_batches(2)
    assert [b.shape[0] for b in held] == [2, 2, 1]            # every held-out row once, the last batch short
    assert (torch.cat(held)[:, 0] // seq_len).tolist() == list(range(45, 50))
    assert [b.shape[0] for b in stream.eval_batches(2, drop_last=True)] == [2, 2]
    assert all(b.dtype == torch.long and b.shape[1] == seq_len for b in held)
    assert TokenBatches(6, seq_len, n_rows * seq_len, tokens).eval_batches(2) == []


def test_ranks_take_disjoint_rows_of_each_step():
    tokens = torch.arange(40 * 3)
    ranks = [TokenBatches(rows=4, seq_len=3, vocab=120, tokens=tokens, seed=9, rank=r, world=2) for r in range(2)]
    for a, b in zip(*(_take(r, 10) for r in ranks)):
        assert set(a[:, 0].tolist()).isdisjoint(b[:, 0].tolist())


def test_too_little_data_says_how_many_tokens_are_needed():
    with pytest.raises(ValueError, match=r"--data has 85 tokens: 8 rows .* 1 of them held out.* at least 90 tokens"):
        TokenBatches(rows=8, seq_len=10, vocab=100, tokens=torch.zeros(85, dtype=torch.long), holdout=0.1)
    TokenBatches(rows=8, seq_len=10, vocab=100, tokens=torch.zeros(90, dtype=torch.long), holdout=0.1)
    with pytest.raises(ValueError, match="give at least 90 tokens"):
        TokenBatches(rows=8, seq_len=10, vocab=100, tokens=torch.zeros(89, dtype=torch.long), holdout=0.1)


def test_ids_beyond_the_vocabulary_and_mismatched_states_are_refused():
    with pytest.raises(ValueError, match="token ids go up to 100 .* vocabulary has 100"):
        TokenBatches(rows=1, seq_len=2, vocab=100, tokens=torch.arange(101))
    stream = TokenBatches(rows=2, seq_len=2, vocab=100, tokens=torch.arange(100))
    with pytest.raises(ValueError, match="resume with the same --data, --seq-len, --holdout"):
        TokenBatches(rows=2, seq_len=4, vocab=100, tokens=torch.arange(100)).load_state_dict(stream.state_dict())
    with pytest.raises(ValueError, match="--holdout must be"):
        TokenBatches(rows=2, seq_len=2, vocab=100, tokens=torch.arange(100), holdout=1.0)


def test_synthetic_stream_resumes_and_draws_from_the_batches_corpus():
    make = lambda seed: TokenBatches(rows=4, seq_len=6, vocab=50, seed=seed, holdout=0.1)
    straight = _take(make(5), 40)                        # 64 synthetic rows, 6 held out: 14 steps an epoch
    first = make(5)
    _take(first, 17)
    resumed = make(0)                                    # the saved seed wins, corpus and all
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert all(torch.equal(a, b) for a, b in zip(straight[17:], _take(resumed, 23)))
    corpus = {tuple(r) for r in synthetic_corpus(4, 6, 50, torch.Generator().manual_seed(5)).tolist()}
    drawn = {tuple(r) for b in itertools.islice(batches(4, 6, 50, seed=5), 20) for r in b.tolist()}
    ours = {tuple(r) for b in [*straight, *make(5).eval_batches(8)] for r in b.tolist()}
    assert drawn <= corpus and ours <= corpus and len(ours) > 58
