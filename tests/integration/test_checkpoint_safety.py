"""Checkpoints that never lie (#31): a kill at any moment of a save, a rotation or a delete leaves a checkpoint that
resumes exactly; a mixed, half-deleted, truncated or corrupted one is refused in one line naming the file; --keep
counts complete checkpoints only; a dead run's leftovers go; a fresh run does not take over another run's folder.

Kills are exact: a child forked from this process (torch already imported: it starts at once) trains and SIGKILLs
itself at the n-th rename/replace/unlink/rmdir of a save or rotation, for every n until the run completes (or at
a named point of sltune.training.checkpoints, SLTUNE_CRASH_AT); this process then resumes in-process and compares
losses and weights bit for bit with an uninterrupted run."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sltune import SpeedLoaderConfig
from sltune.cli.main import main
from sltune.training import checkpoints
from sltune.training.loop import TrainJob, find_inputs, run
from tests.support.children import in_child
from tests.support.runtime import one_thread  # noqa: F401 - a module-wide fixture: one intra-op thread

CFG = SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=1, num_live_blocks=1)
KNOBS = ["--model", "llama-tiny", "--seq-len", "16", "--sub-batch-size", "1", "--num-sub-batches", "1",
         "--num-live-blocks", "1"]


def job(save, steps, **kw) -> TrainJob:
    return TrainJob(model="llama-tiny", config=CFG, seq_len=16, steps=steps, save=str(save) if save else None,
                    **{k: str(v) if k == "resume" else v for k, v in kw.items()})


@pytest.fixture(scope="module")
def straight():
    """An uninterrupted run's losses (steps 1-8) and its weights after each step count a test ends at."""
    losses = [s["loss"] for s in run(job(None, 8)).steps]
    weights = {n: {k: v.clone() for k, v in run(job(None, n)).engine.state_dict().items()} for n in (4, 6, 8)}
    return losses, weights


def kill_at_fs_op(n: int, window=lambda name, args: True):
    """In the child: SIGKILL just before the n-th rename, replace, unlink or rmdir made while a save or a rotation
    runs (whatever the implementation: any file made visible or deleted is such an operation). `window(name,
    args)` says whether a call of save_checkpoint/prune counts."""
    def install():
        count = {"ops": 0, "on": 0}

        def fs(orig):
            def call(*a, **k):
                if count["on"]:
                    count["ops"] += 1
                    if count["ops"] == n:
                        os.kill(os.getpid(), signal.SIGKILL)
                return orig(*a, **k)
            return call

        for name in ("replace", "rename", "unlink", "rmdir"):
            setattr(os, name, fs(getattr(os, name)))
        for name in ("save_checkpoint", "prune"):
            orig = getattr(checkpoints, name)

            def counted(*a, _orig=orig, _name=name, **k):
                on = window(_name, a)
                count["on"] += on
                try:
                    return _orig(*a, **k)
                finally:
                    count["on"] -= on
            setattr(checkpoints, name, counted)
    return install


def leftovers(save: Path) -> list[str]:
    """What a run left in its folder besides the checkpoints and the lock file (which stays, unlocked)."""
    return [p.name for p in save.iterdir() if p.name.startswith(".") and p.name != checkpoints.LOCK]


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    """The weights as stepped: the folder's, or its float32 copy when it is saved in another dtype."""
    exact = folder / "training_state" / "weights.safetensors"
    return load_file(exact if exact.is_file() else folder / "model.safetensors")


def assert_weights(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    got = weights_of(folder)
    for name, value in got.items():
        assert torch.equal(value, expected[name]), (folder, name)


def looks_complete_is_complete(save: Path) -> None:
    """No visible checkpoint-N folder lacks a part (a half-written or half-deleted one must not be seen)."""
    for folder in save.glob("checkpoint-*"):
        for part in ("config.json", "model.safetensors", "training_state/trainer.pt",
                     "training_state/optimizer-rank0-of-1.pt"):
            assert (folder / part).is_file(), f"{folder} is visible without {part}: {sorted(os.listdir(folder))}"


def resume_and_compare(save: Path, steps: int, straight) -> int:
    """Resume `save` in this process to `steps`; the losses and the final weights must be the straight run's.
    Returns the step resumed from."""
    losses, weights = straight
    folder, trainer = checkpoints.latest(save)
    done = int(trainer["step"])
    if done < steps:
        report = run(job(save, steps, resume=save))
        assert [s["loss"] for s in report.steps] == losses[done:steps], (save, done)
    assert_weights(save, weights[steps])
    return done


# -- H1: the final save into an existing folder --------------------------------------------------------------
def test_a_kill_at_any_moment_of_the_final_save_into_an_existing_folder_resumes_exactly(tmp_path, straight):
    """`train --steps 3 --save D`, then `--steps 6 --save D --resume D` killed at each rename/delete of its final
    save: D is the step-3 checkpoint or the step-6 one, never step-6 weights with step-3 state."""
    base = tmp_path / "base"
    run(job(base, 3))
    n = 0
    while True:
        n += 1
        save = tmp_path / f"k{n}"
        shutil.copytree(base, save)
        said = in_child(lambda: run(job(save, 6, resume=save)), kill=kill_at_fs_op(n))
        if said.startswith("done"):
            break
        assert said == "killed", said
        resume_and_compare(save, 6, straight)
    assert n > 4, n                                 # the save did that many visible steps, each killed once
    assert not leftovers(save)        # nothing left behind


# -- H2 and M1: rotation, and deleting ---------------------------------------------------------------------------
def test_a_kill_during_a_checkpoint_or_its_rotation_then_a_resume_with_keep_1_loses_nothing(tmp_path, straight):
    """--save-every 2 --keep 2 killed at each rename/delete of checkpoint-6's save and rotation; a resume with
    --save-every 1 --keep 1 killed as it starts its second checkpoint; the next resume continues exactly. Every
    visible checkpoint is whole at every moment."""
    n = 0
    while True:
        n += 1
        save = tmp_path / f"k{n}"
        window = {"on": False}

        def around_six(name, args, window=window):
            if name == "save_checkpoint":
                window["on"] = Path(args[0]).name == "checkpoint-6"
            return window["on"]

        said = in_child(lambda: run(job(save, 8, save_every=2, keep=2)), kill=kill_at_fs_op(n, around_six))
        if said.startswith("done"):
            break
        assert said == "killed", said
        looks_complete_is_complete(save)
        before = int(checkpoints.latest(save, warn=lambda _: None)[1]["step"])
        assert before >= 4, before

        saves = {"n": 0}

        def second_save(saves=saves):
            orig = checkpoints.save_checkpoint

            def counted(*a, **k):
                saves["n"] += 1
                if saves["n"] == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                return orig(*a, **k)
            checkpoints.save_checkpoint = counted

        said = in_child(lambda: run(job(save, 8, save_every=1, keep=1, resume=save)), kill=second_save)
        assert said == "killed", said
        looks_complete_is_complete(save)
        assert resume_and_compare(save, 8, straight) >= before + 1
    assert n > 4, n


def test_a_half_deleted_checkpoint_is_refused_naming_the_missing_file(tmp_path):
    """A checkpoint folder with trainer.pt and no model.safetensors resumed on seeded random weights (exit 0)."""
    save = tmp_path / "run"
    run(job(save, 4, save_every=2))
    (save / "checkpoint-2" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"checkpoint-2/model\.safetensors: missing"):
        find_inputs(job(None, 6, resume=save / "checkpoint-2"))
    # the newest one half-deleted: skipped, saying so, for the complete one before it
    run(job(tmp_path / "two", 4, save_every=2))
    (tmp_path / "two" / "model.safetensors").unlink()
    said = []
    folder, trainer = checkpoints.latest(tmp_path / "two", warn=said.append)
    assert folder == tmp_path / "two" / "checkpoint-2" and trainer["step"] == 2
    assert len(said) == 1 and f"{tmp_path / 'two' / 'model.safetensors'}: missing" in said[0], said


# -- M3: checksums; a mix of two checkpoints ------------------------------------------------------------------
def test_a_corrupted_or_mixed_checkpoint_is_one_line_naming_the_file(tmp_path, capsys):
    save = tmp_path / "run"
    run(job(save, 3))
    optimizer = save / "training_state" / "optimizer-rank0-of-1.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0x40                                # a flipped bit: the same size
    optimizer.write_bytes(bytes(data))
    assert main(["train", *KNOBS, "--steps", "5", "--resume", str(save)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{optimizer}: checksum mismatch" in err, err

    other = tmp_path / "other"                                  # step-6 weights beside step-3 state
    run(job(other, 3))
    run(job(other, 6, resume=other))
    mixed = tmp_path / "mixed"
    run(job(mixed, 3))
    shutil.copy(other / "model.safetensors", mixed / "model.safetensors")
    with pytest.raises(ValueError, match=r"mixed/model\.safetensors: "):
        checkpoints.latest(mixed)
    with pytest.raises(ValueError, match=r"model\.safetensors: the weights of step 6 of run \w+, but .* is step 3 "
                                         r"of run \w+: parts of two checkpoints"):
        checkpoints.verify(mixed, checksums=False)


# -- item 9: messages that name the file ------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["fake", "truncated"])
def test_a_fake_or_truncated_state_file_is_one_line_naming_it(tmp_path, capsys, damage):
    save = tmp_path / "run"
    run(job(save, 2))
    file = save / "training_state" / "optimizer-rank0-of-1.pt"
    data = file.read_bytes()
    file.write_bytes(b"not a checkpoint" if damage == "fake" else data[:len(data) // 3])
    assert main(["train", *KNOBS, "--steps", "4", "--resume", str(save)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sltune train: error: ") and f"{file}: " in err, err
    assert "unexpected" not in err and "Traceback" not in err


def test_a_full_disk_during_a_save_names_the_file_and_leaves_the_last_checkpoint(tmp_path):
    """The file size limit (RLIMIT_FSIZE, as a full disk fails a write) lets the weights (1 MB) through and stops
    the optimizer state (2 MB): torch's '[enforce fail at inline_container.cc:672]' becomes one line naming it."""
    save = tmp_path / "run"
    run(job(save, 2))

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_500_000, resource.RLIM_INFINITY))

    said = in_child(lambda: run(job(save, 4, resume=save)), kill=small_disk)
    file = save / "training_state" / "optimizer-rank0-of-1.pt"
    assert said.startswith(f"error: OSError: {file}: could not save the checkpoint ("), said
    assert "free space" in said and "\n" not in said, said
    assert not leftovers(save)        # the half-written copy is gone
    assert checkpoints.latest(save)[1]["step"] == 2                               # the last checkpoint is intact


# -- item 10: what dead runs left ----------------------------------------------------------------------------------
def test_a_run_removes_what_dead_runs_left_in_its_save_folder(tmp_path):
    """Under the folder's lock whatever a run finds there is dead, whatever pid names it (this process's own
    included: a restarted container's run can have the dead run's pid)."""
    save = tmp_path / "run"
    run(job(save, 2, save_every=1))
    pid = os.getpid()
    dead_ones = [save / f".sltune-tmp-{pid}", save / ".training_state.tmp", save / f".sltune-save-{pid}",
                 save / f".sltune-trash-{pid}-checkpoint-9", save / "checkpoint-1" / ".training_state.old",
                 save / f".sltune-ckpt-{pid}-checkpoint-3", save / f".sltune-tmp-{os.getppid()}"]
    for folder in dead_ones:
        (folder / "training_state").mkdir(parents=True)
        (folder / "training_state" / "trainer.pt").write_bytes(b"x" * 1000)
    (save / f".tokenizer.json.sltune-tmp-{pid}").write_text("{}")
    run(job(save, 3, resume=save))
    assert not [p for p in dead_ones if p.exists()], [p.name for p in dead_ones if p.exists()]
    assert not leftovers(save)


# -- item 11: another run's folder ---------------------------------------------------------------------------------
def test_a_fresh_run_into_another_runs_folder_is_refused_and_overwrite_replaces_its_checkpoints(tmp_path, capsys):
    save = tmp_path / "run"
    run(job(save, 8, save_every=2, keep=2))                     # checkpoint-4, checkpoint-6 and the final folder
    with pytest.raises(ValueError, match=r"--save .* holds checkpoints of another run.*--overwrite"):
        find_inputs(job(save, 4, save_every=1, keep=2))          # before the model loads
    assert main(["train", *KNOBS, "--steps", "4", "--save-every", "1", "--save", str(save)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err, err
    theirs = checkpoints.latest(save)[1]["run"]

    report = run(job(save, 4, save_every=1, keep=2, overwrite=True))
    assert len(report.steps) == 4
    assert sorted(p.name for p in save.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    folder, trainer = checkpoints.latest(save)
    assert folder == save and trainer["step"] == 4 and trainer["run"] != theirs
    for name in ("checkpoint-2", "checkpoint-3"):
        assert checkpoints.verify(save / name)[0]["run"] == trainer["run"]

    # a resume from an older checkpoint of the run, newer ones beside it: refused too (rotation would mix them)
    with pytest.raises(ValueError, match=r"holds checkpoint-3, newer \(step 3\) than the checkpoint --resume"):
        find_inputs(job(save, 6, save_every=1, resume=save / "checkpoint-2"))


# -- every named kill point ------------------------------------------------------------------------------------------
def test_every_named_crash_point_leaves_a_checkpoint_that_resumes_exactly(tmp_path, straight):
    """SLTUNE_CRASH_AT at each point (its first and second time): from a final folder at step 2 to step 8 with
    --save-every 2 --keep 1, so the run writes checkpoint-4 and -6, rotates -4 away and replaces the final folder;
    and (commit.tombstoned) from checkpoint-2 of a folder whose checkpoint-4 is damaged, which the run rewrites.
    Saved in bfloat16, so each checkpoint has the float32 weights.safetensors too (save.exact)."""
    plain = tmp_path / "plain"
    run(job(plain, 2, save_dtype="bfloat16"))
    damaged = tmp_path / "damaged"
    run(job(damaged, 6, save_every=2, keep=3, save_dtype="bfloat16"))
    shutil.rmtree(damaged / "training_state")
    (damaged / "checkpoint-4" / "model.safetensors").write_bytes(b"torn")
    for point in checkpoints.CRASH_POINTS:
        for nth in (1, 2):
            save = tmp_path / f"{point}@{nth}"
            shutil.copytree(damaged if point == "commit.tombstoned" else plain, save)
            said = in_child(lambda: run(job(save, 8, save_every=2, keep=1, resume=save)), crash=f"{point}@{nth}")
            if said.startswith("done"):
                assert nth == 2, point                      # every point is reached; some only once
                continue
            assert said == "killed", (point, said)
            looks_complete_is_complete(save)
            assert resume_and_compare(save, 8, straight) >= 2
            assert json.loads((save / "training_state" / "manifest.json").read_text())["step"] == 8


# -- review of #31 ---------------------------------------------------------------------------------------------------
def test_a_save_folder_named_checkpoint_n_is_not_replaced_whole_at_the_final_save(tmp_path):
    """--save out/checkpoint-1000 is the run's folder, not one of its periodic checkpoints: the final save replaces
    its files in place; the run's checkpoint-N folders and the user's files in it stay."""
    save = tmp_path / "checkpoint-1000"
    save.mkdir()
    (save / "notes.txt").write_text("mine")
    run(job(save, 4, save_every=1, keep=2))
    assert (save / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in save.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert checkpoints.latest(save)[0] == save and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1000"]


def test_a_second_run_on_the_folder_is_refused_and_what_a_dead_run_left_is_dead_whatever_its_pid(tmp_path):
    """The folder's lock, not a pid, says who writes there: a run is refused in one line naming the lock file and
    its holder while another holds it (and the holder's unit stays, whatever pid names it); a complete save a dead
    run left under this process's own pid (a restarted container's run) is finished, not taken for ours."""
    import socket

    save = tmp_path / "run"
    run(job(save, 2))
    writing = save / ".sltune-ckpt-999999-checkpoint-3"     # the holder's, its pid from another namespace
    (writing / "training_state").mkdir(parents=True)
    lock = checkpoints.hold(save)
    try:
        said = in_child(lambda: run(job(save, 4, resume=save)))
    finally:
        lock.release()
    assert said.startswith(f"error: FolderBusy: --save {save}: another run is saving into it (pid {os.getpid()} on "
                           f"host {socket.gethostname()} holds {save / checkpoints.LOCK})"), said
    assert "\n" not in said and writing.is_dir()

    assert in_child(lambda: run(job(save, 4, resume=save)), crash="final.file@3") == "killed"
    unit = next(save.glob(".sltune-save-*"))
    unit.rename(save / f".sltune-save-{os.getpid()}")
    assert checkpoints.latest(save)[1]["step"] == 4               # finished, not skipped for a mix of two
    assert not leftovers(save)


def test_recovery_finishes_no_unit_over_a_newer_checkpoint(tmp_path):
    """A half-moved final save of run A, found in a folder run B has since completed at the same step, and A's
    checkpoint-1 left as a unit beside B's complete checkpoint-1: both are discarded, B's stay as they are."""
    a, b = tmp_path / "a", tmp_path / "b"
    run(job(a, 2, save_every=1))
    assert in_child(lambda: run(job(a, 4, resume=a)), crash="final.file@3") == "killed"
    run(job(b, 4, save_every=1, keep=3))
    theirs = checkpoints.verify(b)[0]["run"]
    unit = next(a.glob(".sltune-save-*"))
    unit.rename(b / unit.name)
    shutil.copytree(a / "checkpoint-1", b / ".sltune-ckpt-999999-checkpoint-1")
    folder, trainer = checkpoints.latest(b)
    assert folder == b and trainer["step"] == 4 and trainer["run"] == theirs
    assert checkpoints.verify(b / "checkpoint-1")[0]["run"] == theirs
    assert not leftovers(b)


def test_model_folder_with_a_complete_save_left_aside_is_finished_or_refused_while_a_run_holds_it(tmp_path):
    """--model D, where a killed run left its final save half moved into D: D's files are part old, part new. With
    D's lock free the save is finished first; with a live run holding it, one line says to wait or --resume D."""
    save = tmp_path / "run"
    run(job(save, 2))
    assert in_child(lambda: run(job(save, 4, resume=save)), crash="final.file@3") == "killed"
    model = TrainJob(model=str(save), config=CFG, seq_len=16, steps=2)
    lock = checkpoints.hold(save)
    try:
        said = in_child(lambda: find_inputs(model))
    finally:
        lock.release()
    assert said.startswith(f"error: ValueError: --model {save}: a run is saving into it (pid {os.getpid()} "), said
    assert f"--resume {save}" in said and "\n" not in said
    find_inputs(model).release()
    assert checkpoints.verify(save)[0]["step"] == 4 and not leftovers(save)


def test_a_bug_while_saving_is_not_reported_as_a_full_disk(tmp_path, monkeypatch):
    save = tmp_path / "run"
    orig = torch.save

    def buggy(obj, f, *a, **k):
        if "optimizer" in str(f):
            raise TypeError("a bug in the optimizer's state_dict")
        return orig(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", buggy)
    with pytest.raises(TypeError, match="a bug in"):
        run(job(save, 1))
    assert not leftovers(save)


def test_the_steps_left_are_those_of_the_checkpoint_resumed_and_an_unfinished_one_is_named(tmp_path):
    """--steps 4 against a folder whose step-4 final checkpoint is damaged resumes checkpoint-2 (it has steps
    left), not 'pass a larger --steps'; a checkpoint-N without a manifest is named unfinished, with --overwrite."""
    save = tmp_path / "run"
    run(job(save, 4, save_every=2))
    weights = save / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0x40
    weights.write_bytes(bytes(data))
    inputs = find_inputs(job(None, 4, resume=save))
    assert inputs.resumed == save / "checkpoint-2" and inputs.trainer["step"] == 2

    (save / "checkpoint-5" / "training_state").mkdir(parents=True)
    (save / "checkpoint-5" / "training_state" / "trainer.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"holds .*checkpoint-5, unfinished \(no manifest\.json\); pass --overwrite"):
        find_inputs(job(save, 8, resume=save))


def two_ranks(tmp_path, fn, name: str, timeout: float = 30.0) -> list[str]:
    """fn(rank) on two forked ranks joined by gloo: each rank's 'done <result>' or 'error: <its one line>', or
    'hung' when it did not end within `timeout`."""
    import datetime
    import time

    from sltune.cli.main import error_line

    store, pids, pipes = tmp_path / f"gloo-{name}", [], []
    for rank in range(2):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                     # pragma: no cover - a rank
            try:
                os.close(r)
                torch.set_num_threads(1)
                torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                                                     timeout=datetime.timedelta(seconds=timeout / 2))
                message = f"done {fn(rank)}"
            except BaseException as err:   # noqa: BLE001 - reported to the parent
                message = f"error: {type(err).__name__}: {error_line(err)}"
            os.write(w, message.encode()[:8000])
            os._exit(0)
        os.close(w)
        pids.append(pid)
        pipes.append(r)
    deadline, said = time.monotonic() + timeout, []
    for pid, r in zip(pids, pipes):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                said.append("hung")
                break
            time.sleep(0.02)
        else:
            with os.fdopen(r, "rb") as f:
                said.append(f.read().decode())
            continue
        os.close(r)
    return said


class TinyEngine:
    """What save_checkpoint reads of an engine: a model, its state, an optimizer."""

    def __init__(self) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.scaler = None

    def state_dict(self):
        return self.model.state_dict()

    def untied(self, state):
        return state


def test_two_ranks_fail_together_in_one_line_and_resume_the_checkpoint_rank_0_picked(tmp_path):
    """Rank 1's optimizer state cannot be written: both ranks raise the same line naming its file, at once (no rank
    left at a barrier). Resuming, rank 1 loads the checkpoint rank 0 picked, not the one it found; a rank that sees
    another step there than rank 0 is one line on both."""
    save = tmp_path / "run"
    run(job(save, 4, save_every=2))
    _, at_4 = checkpoints.latest(save)

    def failing(rank):
        if rank == 1:
            orig = torch.save

            def full(obj, f, *a, **k):
                if "optimizer" in str(f):
                    raise OSError(28, "No space left on device")
                return orig(obj, f, *a, **k)
            torch.save = full
        checkpoints.save_checkpoint(tmp_path / "two" / "checkpoint-1", TinyEngine(), {"step": 1, "run": "r"},
                              torch.float32, owner=1, periodic=True)

    said = two_ranks(tmp_path, failing, "fail")
    file = tmp_path / "two" / "checkpoint-1" / "training_state" / "optimizer-rank1-of-2.pt"
    assert said[0] == said[1] and said[0].startswith(f"error: OSError: {file}: on rank 1: could not save"), said
    assert not [p.name for p in (tmp_path / "two").iterdir() if p.name != checkpoints.LOCK]     # nothing half-written

    def picks(rank):
        if rank == 0:
            folder, trainer = checkpoints.agree(save, at_4)
        else:                                   # what this rank found (before rank 0 finished recovering, say)
            folder, trainer = checkpoints.agree(*checkpoints.latest(save / "checkpoint-2"))
        return f"{folder.name}@{trainer['step']}"

    assert two_ranks(tmp_path, picks, "pick") == ["done run@4", "done run@4"]

    def disagree(rank):
        return checkpoints.agree(save, {**at_4, "step": 5} if rank == 0 else None)

    said = two_ranks(tmp_path, disagree, "disagree")
    assert said[0] == said[1] and f"{save / 'training_state' / 'trainer.pt'}: step 4 of run" in said[0], said
    assert "but rank 0 resumes step 5" in said[0] and "\n" not in said[0]
