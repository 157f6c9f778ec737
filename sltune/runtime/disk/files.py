"""The disk tier's files as they lie on disk, apart from the engine that pumps them (sltune.runtime.disk.state): a
block file's sections and their checksums, the manifest's format (load_manifest: this tier's fields of
sltune.runtime.disk.manifest's file), the optimizer's counters file, and a committed version read back
(read_committed) or checked file by file (check_files) by a resume that has no engine yet."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from sltune.runtime.disk import checksum
from sltune.runtime.disk import manifest as manifest_file
from sltune.runtime.disk.checksum import feed
from sltune.runtime.disk.checksum import streaming as checksum_streaming
from sltune.runtime.disk.durable import replace_durably
from sltune.runtime.disk.layout import padded
from sltune.runtime.disk.manifest import ManifestError

MANIFEST = manifest_file.NAME


TORN = "manifest.torn.json"     # disk_versions 1: the manifest set aside while a step drops its version's files


TORN_FIX = "resume from the last checkpoint with --resume, or use disk_versions: 2 to keep a failed step's rollback"


CHECKSUMS = checksum.ONE_SHOT       # checksum name -> function of a buffer giving an int (sltune.runtime.disk.checksum)


CHECKSUM = checksum.NAME            # what this tier's new files are summed with


class IntegrityError(ManifestError):
    """A file of the disk tier (or its manifest) is not what was written: one line naming the file."""


class TornError(IntegrityError):
    """disk_versions 1: a step failed after it had dropped files of the version it replaced, so no complete version
    is left to roll back to (or, for a folder, to read): one line saying so and the fix."""


def block_sections(numel: int, master: bool,
                   layout: Sequence[tuple[str, torch.dtype]]) -> tuple[int | None, list[int], int]:
    """A block file's layout, for the engine that writes it and for read_committed: the byte offset of its float32
    master section (None without a master), of each optimizer state section (aligned to its dtype), and the
    total."""
    off, at_master = 0, None
    if master:
        at_master, off = 0, numel * 4
    states = []
    for _, dtype in layout:
        off = -(-off // dtype.itemsize) * dtype.itemsize
        states.append(off)
        off += numel * dtype.itemsize
    return at_master, states, off


def file_sections(numel: int, master: bool, layout: Sequence[tuple[str, torch.dtype]],
                  with_state: bool) -> list[tuple[str, int, int]]:
    """The sections a block file holds, each (name, first byte, end byte): its master (when it has one), then its
    optimizer state's tensors when `with_state`; one checksum each, in this order."""
    at_master, states, _ = block_sections(numel, master, layout)
    out = [("master", at_master, at_master + numel * 4)] if at_master is not None else []
    if with_state:
        out += [(key, off, off + numel * dtype.itemsize) for off, (key, dtype) in zip(states, layout)]
    return out


def bytes_of(buf: Any) -> Any:
    return buf.numpy() if torch.is_tensor(buf) else buf


def checksums(buf: Any, ranges: Sequence[tuple[int, int]], checksum: str | None = None) -> list[int]:
    """The checksum of each byte range of buf (a uint8 tensor, or anything with the buffer protocol)."""
    values, fn = bytes_of(buf), CHECKSUMS[checksum or CHECKSUM]
    return [fn(values[a:b]) for a, b in ranges]


def verify(path: Path, buf: Any, sections: Sequence[tuple[str, int, int]], sums: Sequence[int],
           checksum: str) -> None:
    """buf holds the file's bytes (its first ones at least): each section's checksum must be the one recorded,
    else an IntegrityError naming the file."""
    fn, values = CHECKSUMS[checksum], bytes_of(buf)
    for (name, a, b), want in zip(sections, sums):
        got = fn(values[a:b])
        if got != want:
            raise mismatch(path, name, checksum, got, want)


def mismatch(path: Path, section: str, checksum: str, got: int, want: int) -> IntegrityError:
    return IntegrityError(f"{path}: checksum mismatch in its {section} section ({checksum} {got:x}, the manifest says "
                          f"{want:x}): the file changed after it was written (damaged storage or another writer); "
                          "resume from another checkpoint")


# Files read whole and found to hold what their manifest says, in this process: (device, inode, mtime, size) and
# the sections and sums they were checked against. A checkpoint's blocks are hard links of the engine's files, so
# the same inode is named by the checkpoint --resume picks and by the folder adopt links it into; a write changes
# the mtime (and a replaced file is another inode), so an entry never vouches for other bytes.
FOUND_WHOLE: set[tuple[Any, ...]] = set()


def check_files(folder: str | Path) -> set[str]:
    """Every file a disk checkpoint's manifest names, read whole and checked against its checksums: each block
    section by section, each unit's frozen masters, the optimizer's counters; an IntegrityError naming the first
    that is not what was written. Returns the names checked. What --resume runs as it picks a checkpoint
    (sltune.training.checkpoints.verify), so a damaged block is found while an older checkpoint can still be
    picked, not when adopt or read_committed reads it; a block found whole is remembered (FOUND_WHOLE), and adopt
    links it without reading it again. Streamed in chunks: a 192 MiB block takes 8 MiB of memory to check."""
    folder = Path(folder)
    manifest = load_manifest(folder)
    layout = [(key, getattr(torch, dtype)) for key, dtype in manifest["layout"]]
    checked = {MANIFEST}
    for entry in manifest["blocks"]:
        if entry["file"] is None:
            continue
        path = member(folder, entry["file"])
        sections = file_sections(entry["numel"], manifest["master"], layout, entry["has_state"])
        check_size(path, sections[-1][2] if sections else 0)
        sums = parse_sums(entry)
        if sums is not None:
            _check_sections(path, sections, sums, manifest["checksum"])
        checked.add(path.name)
    for f in manifest.get("frozen", {}).values():
        path = member(folder, f["file"])
        nbytes = 4 * sum(n for _, n in f["ranges"])
        check_size(path, nbytes)
        if f.get("sum") is not None:
            _check_sections(path, [("frozen", 0, nbytes)], [int(f["sum"], 16)], manifest["checksum"])
        checked.add(path.name)
    if manifest["optimizer"] is not None:
        load_small(folder, manifest)
        checked.add(manifest["optimizer"])
    return checked


def _check_sections(path: Path, sections: Sequence[tuple[str, int, int]], sums: Sequence[int],
                    checksum: str) -> None:
    """verify() of a file on disk, read in chunks; remembered in FOUND_WHOLE once it holds."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, checksum, tuple(sections), tuple(sums))
            if key in FOUND_WHOLE:
                return
            for (name, a, b), want in zip(sections, sums):
                h = checksum_streaming(checksum)
                feed(h, f, a, b)
                got = int(h.hexdigest(), 16)
                if got != want:
                    raise mismatch(path, name, checksum, got, want)
    except OSError as err:
        raise IntegrityError(f"{path}: unreadable ({err.strerror or err}), though {path.parent / MANIFEST} names "
                             "it; resume from another checkpoint") from None
    FOUND_WHOLE.add(key)


def found_whole(path: Path, sections: Sequence[tuple[str, int, int]], sums: Sequence[int], checksum: str) -> bool:
    """Whether check_files read this very file (same inode, mtime and size) whole against these sums."""
    try:
        st = path.stat()
    except OSError:
        return False
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size, checksum, tuple(sections), tuple(sums)) in FOUND_WHOLE


def save_small(path: Path, small: dict[str, Any]) -> int:
    """The optimizer's counters as `path` (written as *.tmp, flushed and renamed); returns their checksum."""
    raw = io.BytesIO()
    torch.save(small, raw)
    data = raw.getvalue()
    replace_durably(path, data, folder=False)       # the manifest written next flushes the folder
    return CHECKSUMS[CHECKSUM](data)


def load_small(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's counters the manifest names, verified against its checksum."""
    path = member(folder, manifest["optimizer"])
    try:
        data = path.read_bytes()
    except OSError as err:
        raise IntegrityError(f"{path}: unreadable ({err.strerror or err}), though {folder / MANIFEST} names it; "
                             "resume from another checkpoint") from None
    want = manifest.get("optimizer_sum")
    if want is not None:
        verify(path, data, [("whole", 0, len(data))], [int(want, 16)], manifest["checksum"])
    try:
        small = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:    # noqa: BLE001 - torch raises pickle, zip and runtime errors for a damaged file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise IntegrityError(f"{path}: not a readable optimizer state ({first}); resume from another "
                             "checkpoint") from None
    if not isinstance(small, dict) or not isinstance(small.get("state"), dict):
        raise IntegrityError(f"{path}: not an optimizer state_dict (no 'state'); resume from another checkpoint")
    return small


def member(folder: Path, name: Any) -> Path:
    """A file a manifest names, a plain name in the manifest's folder (sltune.runtime.disk.manifest.member)."""
    return manifest_file.member(folder, name, IntegrityError)


def parse_sums(entry: dict[str, Any]) -> list[int] | None:
    sums = entry.get("sums")
    return None if sums is None else [int(x, 16) for x in sums]


def check_size(path: Path, nbytes: int) -> None:
    """A block file holds its payload padded to pages; a shorter one (or none) is an IntegrityError."""
    try:
        size = path.stat().st_size
    except OSError as err:
        raise IntegrityError(f"{path}: unreadable ({err.strerror or err}), though {path.parent / MANIFEST} names "
                             "it; resume from another checkpoint") from None
    if size < padded(nbytes):
        raise IntegrityError(f"{path}: {size} bytes, short of the {padded(nbytes)} its manifest describes (a "
                             "truncated or foreign file); resume from another checkpoint")


def load_manifest(folder: str | Path) -> dict[str, Any]:
    """An engine's (or a checkpoint's) manifest.json, checked: its structure, its checksum's name, and that every
    file it names is in its folder. Any fault is one IntegrityError line naming the manifest."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        manifest = manifest_file.read(folder, IntegrityError)
    except IntegrityError as err:
        if isinstance(err.__cause__, FileNotFoundError) and (folder / TORN).exists():
            raise TornError(f"{folder}: a step failed (or was killed) mid-way under disk_versions 1, after it had "
                            f"replaced some of the files {TORN} names, so the folder holds no complete version; "
                            "resume from the last checkpoint (--resume)") from None
        fix = "resume from another checkpoint" if err.__cause__ is None else \
            f"{folder} is not an engine's folder or a disk checkpoint's, or is damaged"
        raise IntegrityError(f"{err}; {fix}") from None
    try:
        _check_manifest(manifest)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        if isinstance(err, IntegrityError):
            raise
        what = f"no {err}" if isinstance(err, KeyError) else str(err) or type(err).__name__
        raise IntegrityError(f"{path}: not a manifest of sltune's disk tier ({what}); the manifest is damaged: "
                             "resume from another checkpoint") from None
    manifest.setdefault("checksum", None)
    for name in [manifest["optimizer"], *(b["file"] for b in manifest["blocks"]),
                 *(f["file"] for f in manifest.get("frozen", {}).values())]:
        if name is not None:
            member(folder, name)
    return manifest


def _check_manifest(m: Any) -> None:
    def count(value: Any, what: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{what} is {value!r}, not a count")
        return value

    def hexes(value: Any, what: str) -> None:
        if not isinstance(value, str) or not value or any(c not in "0123456789abcdef" for c in value):
            raise ValueError(f"{what} is {value!r}, not a hex checksum")

    if not isinstance(m, dict):
        raise ValueError(f"a JSON {type(m).__name__}, not an object")
    count(m["version"], "version")
    if not isinstance(m["master"], bool):
        raise ValueError(f"master is {m['master']!r}")
    checksum = m.get("checksum")
    if checksum is not None and checksum not in CHECKSUMS:
        fix = "; install the xxhash package to read it" if checksum == "xxh3_64" else ""
        raise ValueError(f"its checksum {checksum!r} is not one this sltune computes{fix}")
    if m.get("optimizer_sum") is not None:
        hexes(m["optimizer_sum"], "optimizer_sum")
    layout = []
    for key, dtype in m["layout"]:
        kind = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(key, str) or not isinstance(kind, torch.dtype):
            raise ValueError(f"layout entry {[key, dtype]!r}")
        layout.append((key, kind))
    for n, b in enumerate(m["blocks"]):
        numel = count(b["numel"], f"block {n}'s numel")
        if not isinstance(b["has_state"], bool):
            raise ValueError(f"block {n}'s has_state is {b['has_state']!r}")
        total = 0
        for index, size in b["items"]:
            count(index, f"block {n}'s item index")
            total += count(size, f"block {n}'s item size")
        if total != numel:
            raise ValueError(f"block {n}'s items add up to {total}, not its numel {numel}")
        if b["file"] is not None and not isinstance(b["file"], str):
            raise ValueError(f"block {n}'s file is {b['file']!r}")
        sums = b.get("sums")
        if sums is not None:
            if checksum is None:
                raise ValueError(f"block {n} has sums but the manifest names no checksum")
            if not isinstance(sums, list) or len(sums) != len(file_sections(numel, m["master"], layout,
                                                                               b["has_state"])):
                raise ValueError(f"block {n}'s sums are {sums!r}, not one per section")
            for x in sums:
                hexes(x, f"block {n}'s sum")
    for unit, f in m.get("frozen", {}).items():
        for a, size in f["ranges"]:
            count(a, f"{unit}'s frozen range")
            count(size, f"{unit}'s frozen range")
        if f.get("sum") is not None:
            hexes(f["sum"], f"{unit}'s frozen sum")


def read_committed(folder: str | Path) -> dict[str, Any]:
    """The last complete version in an engine's folder (or a checkpoint's): {"version", "optimizer" (the
    counters, or None at version 0), "tensors": {index: {"master": tensor, key: tensor, ...}}}, every
    stepped tensor flat, by its place in the optimizer's parameter list."""
    folder = Path(folder)
    manifest = load_manifest(folder)
    layout = [(key, getattr(torch, dtype)) for key, dtype in manifest["layout"]]
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for entry in manifest["blocks"]:
        if entry["file"] is None:
            continue
        path = member(folder, entry["file"])
        numel = entry["numel"]
        sections = file_sections(numel, manifest["master"], layout, entry["has_state"])
        check_size(path, sections[-1][2] if sections else 0)
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(data)
        buf = torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        sums = parse_sums(entry)
        if sums is not None:
            verify(path, buf, sections, sums, manifest["checksum"])
        master, states, _ = block_sections(numel, manifest["master"], layout)
        parts: list[tuple[str, torch.Tensor]] = []
        if master is not None:
            parts.append(("master", buf[master:master + numel * 4].view(torch.float32)))
        if entry["has_state"]:
            parts += [(key, buf[off:off + numel * dtype.itemsize].view(dtype))
                      for off, (key, dtype) in zip(states, layout)]
        at = 0
        for index, n in entry["items"]:      # a tensor sliced over blocks comes in order: its slices appended
            mine = {key: values[at:at + n].clone() for key, values in parts}
            if index in tensors:
                mine = {key: torch.cat([tensors[index][key], t]) for key, t in mine.items()}
            tensors[index] = mine
            at += n
    small = load_small(folder, manifest) if manifest["optimizer"] else None
    return {"version": manifest["version"], "optimizer": small, "tensors": tensors}
