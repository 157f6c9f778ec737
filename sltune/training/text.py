"""Text corpora for `sltune train`: .txt, .jsonl and .parquet documents tokenized into one id stream.

Training wants a flat stream of token ids; people have text. Each document is tokenized without the
tokenizer's own special tokens and followed by its EOS id, so documents are packed with EOS between them
and the model learns where one ends.

Memory stays bounded whatever the documents' length: a .txt is read and decoded in pieces, a document longer
than _PIECE_CHARS is cut into pieces of at most that, and one tokenizer call takes at most _BATCH_CHARS
characters (a fast tokenizer holds about 150 bytes per character of its input while it works: a 50 MB
single-line file took 7.8 GB whole, bench/text_memory.py). A piece ends before a space between two non-space
characters where the text has one: a byte-level BPE (GPT-2's pre-tokenizer) or a Metaspace one (SentencePiece's
split) starts a word there anyway, so the ids equal those of the whole document. A tokenizer that prepends its
space marker to every input (Llama 2's, which has no pre-tokenizer) is found by a probe and given the next piece
without that space instead, which it then adds back: the same ids again. Only a tokenizer that neither rule fits,
or text with no such space in a piece (it is then cut before other whitespace, else anywhere), may tokenize the
few characters at a cut differently from the whole.

Tokenizing a large corpus takes minutes, so the ids are cached beside the data file
(`corpus.txt.sltune-<16 hex>.npy`) under a key that changes whenever the data's bytes, the tokenizer's files or
its EOS id do: a second run with the same inputs reads the cache instead.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
import sys
import tempfile
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
from tqdm import tqdm

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
# the files that define a Hugging Face tokenizer; the cache key hashes whichever of them exist
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")
CACHE_FORMAT = b"sltune-text-v1"       # bump when the packing (special tokens, EOS, dtype) changes
_BATCH_DOCS, _BATCH_CHARS = 1024, 1_000_000   # one tokenizer call: at most this many documents or characters
_PIECE_CHARS = 100_000                        # a longer document is tokenized in pieces of at most this
_READ_BYTES = 1 << 20                         # a .txt is read this much at a time
_CUT_WHITESPACE = re.compile(r"(?<=\S)\s(?=\S)")   # other whitespace between two non-spaces (a cut's fallback)
_PROGRESS_BYTES = 8 << 20                     # show a progress bar for data files at least this large
_warned_dirs: set[Path] = set()


@dataclass(frozen=True)
class TextTokens:
    """The packed ids of a text file, where they are cached and whether this load read that cache."""

    ids: np.ndarray            # 1-D int32
    cache: Path | None         # None when the folder is not writable
    from_cache: bool


def load_tokenizer(folder: str | Path, named: str | None = None) -> Any:
    """A Hugging Face tokenizer saved in `folder` (save_pretrained), never downloaded; it must have an EOS. A
    mistake names the folder as `named` (default "--tokenizer FOLDER"): the user may have given it as --model."""
    folder = Path(folder)
    named = named or f"--tokenizer {folder}"
    if not folder.is_dir():
        raise ValueError(f"{named}: no such folder; pass a folder written by "
                         f"tokenizer.save_pretrained() (tokenizer.json, tokenizer_config.json, ...)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as err:   # transformers raises OSError, ValueError, KeyError... for a folder it can't read
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{named}: not a loadable Hugging Face tokenizer ({first}); pass a folder "
                         f"written by tokenizer.save_pretrained()") from None
    if tok.eos_token is None or tok.eos_token_id is None:
        raise ValueError(f"{named}: the tokenizer has no eos_token, which separates packed documents; "
                         f"set one (tokenizer.eos_token = '</s>'; tokenizer.save_pretrained(folder)) or use another")
    return tok


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` holds any of a tokenizer's files (a model folder saved without one holds none)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def cache_path(path: str | Path, tokenizer: str | Path) -> Path:
    """Where the ids of `path` tokenized by the tokenizer in folder `tokenizer` are (or would be) cached."""
    return _cache_path(Path(path), Path(tokenizer), load_tokenizer(tokenizer).eos_token_id)


def tokenize_file(path: str | Path, tokenizer: str | Path) -> TextTokens:
    """The packed ids of a .txt/.jsonl/.parquet file: each document's ids then EOS, from the cache if current."""
    path, folder = Path(path), Path(tokenizer)
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file")
    if path.suffix not in TEXT_SUFFIXES:
        raise ValueError(f"--data {path}: text must be .txt (one document), .jsonl or .parquet (a 'text' field)")
    tok = load_tokenizer(folder)
    cache = _cache_path(path, folder, tok.eos_token_id)
    ids = _read_cache(cache)
    if ids is not None:
        return TextTokens(ids, cache, True)
    drop = drops_space(tok)
    pieces = _txt_pieces(path, drop) if path.suffix == ".txt" else _pieces(read_documents(path), drop)
    ids = _tokenize_pieces(pieces, tok, progress=_progress(path))
    return TextTokens(ids, cache if _write_cache(cache, ids) else None, False)


def read_documents(path: str | Path) -> Iterator[str]:
    """The documents of a text file, streamed: a .txt is one; a .jsonl line or .parquet row is one each."""
    path = Path(path)
    if path.suffix == ".txt":
        yield _decode(path.read_bytes(), path)
    elif path.suffix == ".jsonl":
        yield from _jsonl(path)
    elif path.suffix == ".parquet":
        yield from _parquet(path)
    else:
        raise ValueError(f"--data {path}: text must be .txt (one document), .jsonl or .parquet (a 'text' field)")


def tokenize_documents(docs: Iterable[str], tokenizer: Any, progress: tqdm | None = None) -> np.ndarray:
    """One int32 stream: each document's ids (no special tokens added) followed by the tokenizer's EOS id,
    tokenized in batched calls (a fast tokenizer spreads each batch over its threads), a long document in
    pieces (see the module's doc)."""
    return _tokenize_pieces(_pieces(docs, drops_space(tokenizer)), tokenizer, progress)


def _tokenize_pieces(pieces: Iterable[tuple[str, bool]], tokenizer: Any, progress: tqdm | None = None) -> np.ndarray:
    """tokenize_documents over (piece, ends its document) pairs: EOS after each document's last piece."""
    eos = int(tokenizer.eos_token_id)
    parts: list[np.ndarray] = []
    batch: list[str] = []
    ends: list[bool] = []
    chars = 0

    def flush() -> None:
        nonlocal chars
        if not batch:
            return
        enc = tokenizer(batch, add_special_tokens=False, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)["input_ids"]
        flat: list[int] = []
        for ids, end in zip(enc, ends):
            flat.extend(ids)
            if end:
                flat.append(eos)
        if flat:
            part = np.asarray(flat, dtype=np.int64)
            if part.min() < 0 or part.max() > np.iinfo(np.int32).max:
                raise ValueError(f"the tokenizer produced ids in [{part.min()}, {part.max()}], outside int32")
            parts.append(part.astype(np.int32))
        if progress is not None:
            progress.update(sum(ends) if progress.unit == "doc" else chars)
        batch.clear()
        ends.clear()
        chars = 0

    try:
        for piece, end in pieces:
            if chars + len(piece) > _BATCH_CHARS:
                flush()
            batch.append(piece)
            ends.append(end)
            chars += len(piece)
            if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                flush()
        flush()
        if progress is not None:
            progress.update(max(0, progress.total - progress.n))   # the estimate falls short: show it done
    finally:
        if progress is not None:
            progress.close()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# -- pieces --------------------------------------------------------------------------------------------
def drops_space(tokenizer: Any) -> bool:
    """Whether pieces cut at a space should give the next piece without it: true for a tokenizer that prepends
    its space marker to every input (so "a b" is "a" then "b"), false for the rest ("a" then " b")."""
    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False, return_attention_mask=False,
                              return_token_type_ids=False, verbose=False)["input_ids"])

    left, right = "Hello, the quick", "brown fox jumps."
    whole = ids(f"{left} {right}")
    return ids(left) + ids(f" {right}") != whole and ids(left) + ids(right) == whole


def _pieces(docs: Iterable[str], drop_space: bool = False) -> Iterator[tuple[str, bool]]:
    """Each document as pieces of at most _PIECE_CHARS characters, the last one flagged."""
    for doc in docs:
        start = 0
        while len(doc) - start > _PIECE_CHARS:
            end, start_next = _cut(doc[start:start + _PIECE_CHARS + 1], drop_space)
            yield doc[start:start + end], False
            start += start_next
        yield doc[start:], True


def _cut(text: str, drop_space: bool = False) -> tuple[int, int]:
    """Where to end a piece of `text` (longer than _PIECE_CHARS; the piece may be no longer than that) and
    where the next starts: before the last space between two non-space characters in the second half of the
    limit (the next piece starts after it with `drop_space`), else before other whitespace between two
    non-spaces there, else at the limit (not between a character and its combining marks)."""
    limit = _PIECE_CHARS
    low = limit // 2
    at = text.rfind(" ", low, limit)
    while at > low:
        if not text[at - 1].isspace() and not text[at + 1].isspace():
            return at, at + 1 if drop_space else at
        at = text.rfind(" ", low, at)
    last = None
    for last in _CUT_WHITESPACE.finditer(text, low, limit):
        pass
    if last is not None:
        return last.start(), last.start()
    at = limit
    while at > low and unicodedata.combining(text[at]):
        at -= 1
    return at, at


def _txt_pieces(path: Path, drop_space: bool = False) -> Iterator[tuple[str, bool]]:
    """A .txt file (one document) as pieces, read and decoded _READ_BYTES at a time: the whole file is never
    in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending, done = "", 0
    with open(path, "rb") as fh:
        while True:
            raw = fh.read(_READ_BYTES)
            try:
                pending += decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as err:
                held = len(err.object) - len(raw)           # the bytes the decoder kept from the last read
                raise ValueError(f"--data {path}: not UTF-8 text (byte {done - held + err.start}); re-encode the "
                                 f"file as UTF-8") from None
            done += len(raw)
            start = 0
            while len(pending) - start > _PIECE_CHARS:
                end, start_next = _cut(pending[start:start + _PIECE_CHARS + 1], drop_space)
                yield pending[start:start + end], False
                start += start_next
            pending = pending[start:]
            if not raw:
                break
    yield pending, True


# -- reading -------------------------------------------------------------------------------------------
def _decode(raw: bytes, path: Path, where: str = "") -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--data {path}{where}: not UTF-8 text (byte {err.start}); re-encode the file as UTF-8") \
            from None


def _jsonl(path: Path) -> Iterator[str]:
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            where = f" line {number}"
            try:
                obj = json.loads(_decode(raw, path, where))
            except json.JSONDecodeError as err:
                raise ValueError(f"--data {path}{where}: not JSON ({err.msg}); each line must be an object "
                                 f'like {{"text": "..."}}') from None
            text = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"--data {path}{where}: no string \"text\" field; each line must be an object "
                                 f'like {{"text": "..."}}')
            yield text


def _parquet(path: Path) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"--data {path}: not a readable Parquet file ({err})") from None
    names = pf.schema_arrow.names
    if "text" not in names:
        raise ValueError(f"--data {path}: no 'text' column (columns: {', '.join(names) or 'none'}); "
                         f"put one document per row in a string column named text")
    kind = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"--data {path}: the 'text' column holds {kind}, not strings; store the documents as text")
    row = 0
    for chunk in pf.iter_batches(columns=["text"], batch_size=_BATCH_DOCS):
        for text in chunk.column(0).to_pylist():
            if text is None:
                raise ValueError(f"--data {path} row {row} (from 0): the text is null; drop that row or give it "
                                 f"a string")
            row += 1
            yield text


def _progress(path: Path) -> tqdm | None:
    """A bar on stderr for large files: Parquet rows by count, else characters against the file's bytes
    (exact for ASCII .txt; JSON syntax and non-ASCII text leave it a little short of the end)."""
    size = path.stat().st_size
    if size < _PROGRESS_BYTES:
        return None
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError):
            return None     # reading it reports the problem
        return tqdm(total=rows, unit="doc", desc=f"tokenize {path.name}",
                    file=sys.stderr)
    return tqdm(total=size, unit="B", unit_scale=True, desc=f"tokenize {path.name}", file=sys.stderr)


# -- the cache -----------------------------------------------------------------------------------------
def _file_sha256(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.digest()


def _cache_path(path: Path, folder: Path, eos_id: int) -> Path:
    key = hashlib.sha256(CACHE_FORMAT)
    key.update(path.suffix.encode() + b"\0" + _file_sha256(path))
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            key.update(name.encode() + b"\0" + _file_sha256(folder / name))
    key.update(f"eos={eos_id}".encode())
    return path.with_name(f"{path.name}.sltune-{key.hexdigest()[:16]}.npy")


def _read_cache(cache: Path) -> np.ndarray | None:
    if not cache.is_file():
        return None
    try:
        ids = np.load(cache, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None       # truncated or foreign: tokenize again and overwrite it
    if ids.ndim != 1 or ids.dtype != np.int32:
        return None
    return ids


def _write_cache(cache: Path, ids: np.ndarray) -> bool:
    """Atomically write the ids; on a folder we can't write, warn once per folder and go on."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=f"{cache.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, ids, allow_pickle=False)
        os.replace(tmp, cache)
        return True
    except OSError as err:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if cache.parent not in _warned_dirs:
            _warned_dirs.add(cache.parent)
            warnings.warn(f"cannot cache token ids in {cache.parent} ({err.strerror or err}); tokenizing without "
                          f"a cache, so every run tokenizes again (make the folder writable to cache)",
                          stacklevel=3)
        return False
