"""optimizer_offload disk checks what it reads (issue 31, M3 and item 9): each block file's sections and the
optimizer's counters carry checksums in the manifest, verified on a resume (adopt), on read_committed (a disk
checkpoint read into a host run), on the reads a checkpoint or a rollback makes, and on every step's read-ahead. A
damaged file, a short one, a malformed manifest or a manifest naming a file outside its folder is one line naming
the file, never a run that goes on with garbage (before: losses [9.25, nan, nan] and exit 0)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.cli.main import main
from sltune.models import build
from sltune.runtime.disk import files as disk_files
from sltune.runtime.disk.files import MANIFEST, read_committed
from tests.support.reference import adamw

SEQ = 16


def engine(folder: Path) -> SpeedLoaderEngine:
    cfg = SpeedLoaderConfig(sub_batch_size=2, num_sub_batches=1, num_live_blocks=1, dtype="bfloat16",
                            optimizer_offload="disk", offload_dir=str(folder))
    return SpeedLoaderEngine(build("llama-tiny", seed=0), cfg, optimizer=adamw)


def batch(seed: int) -> torch.Tensor:
    return torch.randint(3, 512, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A disk checkpoint (link_into's folder) of two steps: copied by each test that damages it."""
    root = tmp_path_factory.mktemp("saved")
    e = engine(root / "off")
    for s in range(2):
        e.train_step(batch(s))
    folder = root / "ckpt"
    e.disk.link_into(folder, e.optimizer.state_dict())
    copy = root / "copy"
    shutil.copytree(folder, copy)          # real copies, not links to the engine's files
    return copy


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ckpt"))


def manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def block_file(folder: Path, n: int = 0) -> Path:
    """The n-th block file with state (the largest first: the embedding's)."""
    entries = sorted((e for e in manifest(folder)["blocks"] if e["file"]), key=lambda e: -e["numel"])
    return folder / entries[n]["file"]


def one_line(err: pytest.ExceptionInfo, path: Path) -> str:
    text = str(err.value)
    assert "\n" not in text and text.startswith(str(path)), text
    return text


# -- a damaged block: same size, 0xFF or 4 KiB of random bytes -------------------------------------------
@pytest.mark.parametrize("damage", ["ff", "random-4k"])
def test_a_damaged_block_refuses_the_resume_naming_the_file(ckpt, tmp_path, damage):
    path = block_file(ckpt)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if damage == "ff":
            f.write(b"\xff" * size)
        else:
            f.write(os.urandom(4096))
    assert path.stat().st_size == size
    e = engine(tmp_path / "off")
    with pytest.raises(ValueError) as err:
        e.disk.adopt(ckpt)
    assert "checksum mismatch in its master section" in one_line(err, path)
    with pytest.raises(ValueError) as err:        # a disk checkpoint read into a host run
        read_committed(ckpt)
    one_line(err, path)


def test_a_truncated_or_missing_block_is_one_line_naming_it(ckpt, tmp_path):
    path = block_file(ckpt, 1)
    with open(path, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(ValueError, match="short of the") as err:
        read_committed(ckpt)                 # before: shorter tensors, "shape '[...]' is invalid" in the host run
    one_line(err, path)
    with pytest.raises(ValueError, match="short of the"):
        engine(tmp_path / "off").disk.adopt(ckpt)
    path.unlink()
    with pytest.raises(ValueError) as err:
        read_committed(ckpt)
    one_line(err, path)


def test_a_damaged_optimizer_file_is_one_line_naming_it(ckpt, tmp_path):
    path = ckpt / "optimizer.pt"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum mismatch") as err:
        read_committed(ckpt)
    one_line(err, path)
    with pytest.raises(ValueError, match="checksum mismatch"):
        engine(tmp_path / "off").disk.adopt(ckpt)


def test_a_clean_checkpoint_still_adopts_and_old_manifests_without_sums_too(ckpt, tmp_path):
    e = engine(tmp_path / "off")
    e.optimizer.load_state_dict(e.disk.adopt(ckpt))     # as sltune.training.checkpoints.restore does
    ours = manifest(e.disk.folder)
    assert ours["checksum"] == disk_files.CHECKSUM and all(b["sums"] for b in ours["blocks"] if b["file"])
    old = manifest(ckpt)                    # as written before checksums: read unverified, then checksummed here
    for key in ("checksum", "optimizer_sum"):
        del old[key]
    for b in old["blocks"]:
        del b["sums"]
    (ckpt / MANIFEST).write_text(json.dumps(old))
    assert read_committed(ckpt)["version"] == 2
    e2 = engine(tmp_path / "off2")
    e2.optimizer.load_state_dict(e2.disk.adopt(ckpt))
    assert all(b.sums is not None for b in e2.disk.blocks if b.file)
    e2.train_step(batch(2))


# -- the manifest --------------------------------------------------------------------------------------
def test_a_bad_manifest_is_one_line_naming_it(ckpt):
    text = (ckpt / MANIFEST).read_text()
    (ckpt / MANIFEST).write_text(text[:27] + "?" + text[28:])
    with pytest.raises(ValueError, match="not valid JSON") as err:
        read_committed(ckpt)                # before: json's bare "Expecting value: line 1 column 28"
    one_line(err, ckpt / MANIFEST)
    m = json.loads(text)
    m["blocks"][0]["numel"] += 1
    (ckpt / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match="items add up to") as err:
        read_committed(ckpt)
    one_line(err, ckpt / MANIFEST)


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink-out"])
def test_manifest_paths_stay_inside_their_folder(ckpt, tmp_path, where):
    path = block_file(ckpt)
    outside = tmp_path / "elsewhere.bin"
    shutil.copyfile(path, outside)          # the same bytes: only the path is wrong
    m = manifest(ckpt)
    entry = next(b for b in m["blocks"] if b["file"] == path.name)
    if where == "absolute":
        entry["file"] = str(outside)
    elif where == "dotdot":
        entry["file"] = f"../{outside.name}"
    else:
        path.unlink()
        path.symlink_to(outside)
    (ckpt / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match="not a file of its own folder|symlink pointing out of its folder"):
        read_committed(ckpt)
    with pytest.raises(ValueError, match="not a file of its own folder|symlink pointing out of its folder"):
        engine(tmp_path / "off").disk.adopt(ckpt)


def test_a_symlink_inside_the_folder_is_followed(ckpt):
    path = block_file(ckpt)
    os.replace(path, ckpt / "moved.bin")
    path.symlink_to("moved.bin")
    assert read_committed(ckpt)["version"] == 2


# -- while training: every step's read, and the reads for a checkpoint -----------------------------------
def test_a_block_damaged_between_steps_fails_the_next_step_naming_it(tmp_path):
    e = engine(tmp_path / "off")
    e.train_step(batch(0))
    block = max((b for b in e.disk.blocks if b.file), key=lambda b: b.numel)
    path = e.disk.folder / block.file
    with open(path, "r+b") as f:
        f.seek(8192)
        f.write(os.urandom(4096))
    with pytest.raises(ValueError) as err:
        e.state_dict()                      # what a checkpoint reads (the masters)
    one_line(err, path)
    with pytest.raises(ValueError) as err:
        e.train_step(batch(1))
    one_line(err, path)
    assert e.disk.version == 1              # rolled back: the committed version is still the first step's


def test_a_damaged_checkpoint_resume_exits_2_with_one_line(tmp_path, capsys):
    """The CLI end to end: `sltune train --resume` of a damaged disk checkpoint, onto disk and onto the host."""
    knobs = ["train", "--model", "llama-tiny", "--seq-len", "16", "--sub-batch-size", "2", "--num-live-blocks", "1",
             "--dtype", "bfloat16", "--steps", "3"]
    disk = ["--optimizer-offload", "disk", "--offload-dir", str(tmp_path / "off")]
    assert main([*knobs, *disk, "--steps", "1", "--save", str(tmp_path / "d")]) == 0
    files = tmp_path / "d" / "training_state" / "optimizer-rank0-of-1"
    path = block_file(files)
    with open(path, "r+b") as f:
        f.write(b"\xff" * path.stat().st_size)
    capsys.readouterr()
    assert main([*knobs, *disk, "--resume", str(tmp_path / "d")]) == 2
    assert main([*knobs, "--resume", str(tmp_path / "d")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    refused = f"sltune train: error: --resume {tmp_path / 'd'}: no complete checkpoint: {path}: checksum mismatch"
    assert len(err) == 2 and all(line.startswith(refused) for line in err), err     # found as the checkpoint is picked
