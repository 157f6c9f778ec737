"""Text corpora for `sltune train`: .txt, .jsonl and .parquet documents tokenized into one id stream.

Training wants a flat stream of token ids; people have text. Each document is tokenized without the
tokenizer's own special tokens and followed by its EOS id, so documents are packed with EOS between them
and the model learns where one ends. Tokenizing a large corpus takes minutes, so the ids are cached
beside the data file (`corpus.txt.sltune-<16 hex>.npy`) under a key that changes whenever the data's bytes,
the tokenizer's files or its EOS id do: a second run with the same inputs reads the cache instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from tqdm import tqdm

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
# the files that define a Hugging Face tokenizer; the cache key hashes whichever of them exist
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")
CACHE_FORMAT = b"sltune-text-v1"       # bump when the packing (special tokens, EOS, dtype) changes
_BATCH_DOCS, _BATCH_CHARS = 1024, 4_000_000   # one tokenizer call: this many documents or characters
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
    ids = tokenize_documents(read_documents(path), tok, progress=_progress(path))
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


def tokenize_documents(docs: Iterator[str] | list[str], tokenizer: Any, progress: tqdm | None = None) -> np.ndarray:
    """One int32 stream: each document's ids (no special tokens added) followed by the tokenizer's EOS id,
    tokenized in batched calls (a fast tokenizer spreads each batch over its threads)."""
    eos = int(tokenizer.eos_token_id)
    parts: list[np.ndarray] = []
    batch: list[str] = []
    chars = 0

    def flush() -> None:
        nonlocal chars
        if not batch:
            return
        enc = tokenizer(batch, add_special_tokens=False, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)["input_ids"]
        flat: list[int] = []
        for ids in enc:
            flat.extend(ids)
            flat.append(eos)
        part = np.asarray(flat, dtype=np.int64)
        if part.min() < 0 or part.max() > np.iinfo(np.int32).max:
            raise ValueError(f"the tokenizer produced ids in [{part.min()}, {part.max()}], outside int32")
        parts.append(part.astype(np.int32))
        if progress is not None:
            progress.update(len(batch) if progress.unit == "doc" else chars)
        batch.clear()
        chars = 0

    try:
        for doc in docs:
            batch.append(doc)
            chars += len(doc)
            if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                flush()
        flush()
        if progress is not None:
            progress.update(max(0, progress.total - progress.n))   # the estimate falls short: show it done
    finally:
        if progress is not None:
            progress.close()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


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
