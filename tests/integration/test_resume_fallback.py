"""Issue #47, item 3: --resume checks every file it will read as it picks a checkpoint, the disk tier's hard-linked
blocks included, and falls back past a damaged one: the issue's repro, `sltune train --optimizer-offload disk
--param-offload disk --save R --save-every 1`, a byte flipped in the newest R/training_state/optimizer-rank0-of-1/
b*.bin, then `--resume R`, run by the CLI in this process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sltune.cli.main import main
from sltune.runtime.disk import direct_io
from tests.support.runtime import one_thread  # noqa: F401 - a module-wide fixture: one intra-op thread

BLOCKS = "training_state/optimizer-rank0-of-1"


def train(save: Path, steps: int, log: Path, *more: str) -> int:
    return main(["train", "--model", "llama-tiny", "--seq-len", "16", "--steps", str(steps), "--optimizer-offload",
                 "disk", "--param-offload", "disk", "--offload-dir", str(save.parent / "offload"), "--save",
                 str(save), "--save-every", "1", "--log", str(log), "--json", *more])


def losses(log: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def flip_a_byte(folder: Path) -> Path:
    """One byte of the newest checkpoint's last block, flipped in place (the size stays)."""
    block = sorted((folder / BLOCKS).glob("b*.bin"))[-1]
    with open(block, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)[0]
        f.seek(1000)
        f.write(bytes([byte ^ 0xFF]))
    return block


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """R after 6 steps (R itself at step 6, checkpoint-3 to -5 beside it), and the losses of a run straight to 8."""
    tmp = tmp_path_factory.mktemp("fallback")
    assert train(tmp / "straight", 8, tmp / "straight.jsonl") == 0
    assert train(tmp / "R", 6, tmp / "R.jsonl") == 0
    return tmp / "R", losses(tmp / "straight.jsonl")


@pytest.mark.parametrize("damaged", [1, 2], ids=["newest", "two-newest"])
def test_resume_skips_a_checkpoint_with_a_damaged_block_for_the_newest_that_verifies(saved, tmp_path, capsys,
                                                                                   monkeypatch, damaged):
    original, straight = saved
    save = tmp_path / "R"
    shutil.copytree(original, save)
    flipped = [flip_a_byte(save)] + ([flip_a_byte(save / "checkpoint-5")] if damaged == 2 else [])
    resumed = 6 - damaged

    reads: list[str] = []           # what the engine reads from the checkpoint as it adopts its blocks
    real_read = direct_io.DirectFiles.read

    def counted(self, path, *args, **kwargs):
        reads.append(str(path))
        return real_read(self, path, *args, **kwargs)

    monkeypatch.setattr(direct_io.DirectFiles, "read", counted)
    capsys.readouterr()
    assert train(save, 8, tmp_path / "resume.jsonl", "--resume", str(save)) == 0

    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sltune: warning:")]
    assert len(warnings) == damaged, warnings
    for line, block in zip(warnings, flipped):
        assert f"{block}: checksum mismatch in its" in line, line
        assert line.endswith(f"resuming {save / f'checkpoint-{resumed}'} (step {resumed})"), line
    got = losses(tmp_path / "resume.jsonl")
    assert sorted(got) == list(range(resumed + 1, 9)) and all(got[s] == straight[s] for s in got), (got, straight)
    chosen = str(save / f"checkpoint-{resumed}" / BLOCKS)
    assert not [r for r in reads if r.startswith(chosen)], "a block checked as the checkpoint was picked was read again"
