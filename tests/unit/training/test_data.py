"""Token batches for training (sltune.training.data): a token file that is not one (a fake .npy, a torn .pt, an
odd-sized .bin) is one line naming the file; float ids are refused, not trained on; narrow signed ids (int8, int16)
are read with a warning, once per file; text needs --tokenizer; and a packed, held-out, resumable batch stream over
the ids."""

from __future__ import annotations

import itertools
import json
import warnings

import numpy as np
import pytest
import torch

from sltune.training.data import TokenBatches, batches, load_tokens, synthetic_corpus
from tests.support.text import tok_dir  # noqa: F401 - a fixture its tests ask for by name


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


def test_token_files_still_load_and_ignore_the_tokenizer(tmp_path, tok_dir):
    np.save(tmp_path / "ids.npy", np.arange(10, dtype=np.uint16))
    assert load_tokens(tmp_path / "ids.npy").tolist() == list(range(10))
    assert load_tokens(tmp_path / "ids.npy", tok_dir).tolist() == list(range(10))


def test_text_without_a_tokenizer_names_the_flag(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello")
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokens(tmp_path / "corpus.txt")


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
