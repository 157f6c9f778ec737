"""param_offload disk, crash-safe (#34, item 4 and "Bad input"): `sltune train --param-offload disk
--optimizer-offload disk` killed with SIGKILL at any moment of a step (a weights file half-made, renamed but not
committed, between the disk tier's manifest and the weights files' commit, while an engine's folder is removed)
resumes exactly: the same losses and final weights, bit for bit, as an uninterrupted run; the next run removes what
the killed one left (its engine folder, weights files `w*-v*.bin` and `*.tmp` included). A full disk, an offload
folder that is read-only or vanishes, a weights or state file truncated or from another model: each is one line
naming the file and the fix, and nothing half-written is ever loaded.

Kills land two ways, both real SIGKILLs of real processes forked from this one (torch already imported: they
start at once): a child kills itself at a named point of the runtime's writes (SLTUNE_CRASH_AT,
sltune.runtime.disk.durable), and a child running `sltune train` on a slowed disk (SLTUNE_DISK_WRITE_DELAY_S) is killed
from outside mid write-behind.
A full disk is a small tmpfs filled at a step, a read-only folder the same tmpfs remounted read-only: both in a
mount namespace of the child's own (unshare; a user namespace too when not root), so nothing outside changes. Where
namespaces are refused, the full disk is the file size limit (RLIMIT_FSIZE) and the read-only folder is skipped,
saying why."""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
import resource
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.cli.main import error_line, main
from sltune.models import build
from sltune.runtime.disk.layout import padded
from sltune.runtime.disk.files import MANIFEST
from sltune.training import checkpoints
from sltune.training.loop import TrainJob, run
from tests.support.children import in_child
from tests.support.runtime import one_thread  # noqa: F401 - a module-wide fixture: one intra-op thread

SEQ, STEPS = 16, 4
# built from configs, smaller than the presets: 4 units (embedding, 2 layers, head), a step in tens of milliseconds
MODEL = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}
OTHER = {"model_type": "qwen2", "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 64}
KNOBS = dict(sub_batch_size=1, num_sub_batches=2, num_live_blocks=1, dtype="bfloat16", optimizer_offload="disk",
             param_offload="disk")
FLAGS = ["--seq-len", str(SEQ), "--sub-batch-size", "1", "--num-sub-batches", "2", "--num-live-blocks", "1",
         "--dtype", "bfloat16", "--optimizer-offload", "disk", "--param-offload", "disk"]


def job(off: Path, save: Path | None, steps: int = STEPS, model: Any = None, **kw: Any) -> TrainJob:
    cfg = SpeedLoaderConfig(**KNOBS, offload_dir=str(off))
    return TrainJob(model=model or MODEL, config=cfg, seq_len=SEQ, steps=steps, save=str(save) if save else None,
                    **{k: str(v) if k == "resume" else v for k, v in kw.items()})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted run: its losses, its final weights, and how many files a step writes per tier (where the
    crash points' counts fall)."""
    tmp = tmp_path_factory.mktemp("straight")
    report = run(job(tmp / "off", tmp / "save"))
    (tmp / "config.json").write_text(json.dumps(MODEL))
    out = {"losses": [s["loss"] for s in report.steps], "weights": load_file(tmp / "save" / "model.safetensors"),
           "flags": ["--model", str(tmp / "config.json"), *FLAGS],
           "blocks": len(report.engine.disk.blocks), "units": len(report.engine.weights.committed),
           "step_bytes": sum(padded(report.engine.disk.nbytes(b, True)) for b in report.engine.disk.blocks)
           + sum(padded(n) for _, n, _ in report.engine.weights.committed)}
    assert len(set(out["losses"])) == STEPS
    return out


def resume_exactly(off: Path, save: Path, straight: dict[str, Any], at_least: int = 1) -> int:
    """Resume `save` in this process to STEPS: the losses and the final weights must be the uninterrupted run's.
    Returns the step resumed from. Every engine folder left in `off` is then this process's own (a dead run's
    went when the resumed run's engine started)."""
    done = int(checkpoints.latest(save, warn=lambda _: None)[1]["step"])
    assert done >= at_least, done
    if done < STEPS:
        report = run(job(off, save, resume=save))
        assert [s["loss"] for s in report.steps] == straight["losses"][done:], (save, done)
    else:                       # nothing left to train: the next run is another one on the same offload_dir
        run(job(off, None, steps=1))
    assert all(f"-{os.getpid()}-" in p.name for p in engine_folders(off)), engine_folders(off)
    weights = load_file(save / "model.safetensors")
    assert weights.keys() == straight["weights"].keys()
    for name, value in weights.items():
        assert torch.equal(value, straight["weights"][name]), name
    return done


# -- children -----------------------------------------------------------------------------------------------------
def at_step(n: int, action: Callable[[], None]) -> None:
    """In a child: run `action` just before the n-th train_step of the process (the filesystem changes under a run
    between two steps, as a full disk or an admin's remount would)."""
    real, calls = SpeedLoaderEngine.train_step, {"n": 0}

    def train_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            action()
        return real(self, *args, **kwargs)

    SpeedLoaderEngine.train_step = train_step


def engine_folders(off: Path) -> list[Path]:
    return sorted(off.glob("sltune-r*")) + sorted(off.glob(".sltune-r*"))


# -- mount namespaces: a tmpfs of the child's own ---------------------------------------------------------------------
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18


def _mount(source: bytes | None, target: Path | str, fstype: bytes | None, flags: int, data: str | None = None):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    if libc.mount(source, str(target).encode(), fstype, flags, data.encode() if data else None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {target}: {os.strerror(code)}")


def private_tmpfs(folder: Path, size: int, read_only: bool = False) -> None:
    """In a (single-threaded, forked) child: a mount namespace of its own (and a user namespace when not root, to
    be allowed one), nothing of it propagated out, and a tmpfs of `size` bytes at `folder`."""
    uid, gid = os.geteuid(), os.getegid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS | (CLONE_NEWUSER if uid != 0 else 0)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"unshare: {os.strerror(code)}")
    if uid != 0:
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
        Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    _mount(b"none", "/", None, MS_REC | MS_PRIVATE)
    folder.mkdir(parents=True, exist_ok=True)
    _mount(b"tmpfs", folder, b"tmpfs", MS_RDONLY if read_only else 0, f"size={size},mode=0777")


def remount_read_only(folder: Path) -> None:
    """`folder` read-only from here on for every path under it, as an admin's remount makes it: a read-only bind of
    it over itself (a remount of the tmpfs would be refused, EBUSY, while the engine's lock file is open)."""
    _mount(str(folder).encode(), folder, None, MS_BIND)
    _mount(None, folder, None, MS_REMOUNT | MS_BIND | MS_RDONLY)


@functools.lru_cache(maxsize=1)
def namespaces() -> str | None:
    """None when a child may mount a tmpfs of its own here; else why not."""
    target = Path(tempfile.mkdtemp(prefix="sltune-ns-probe-"))

    def probe() -> str:
        private_tmpfs(target, 1 << 20)
        (target / "x").write_bytes(b"x" * 8192)
        return "ok"

    said = in_child(probe)
    shutil.rmtree(target, ignore_errors=True)
    return None if said == "done ok" else said


def fill(folder: Path, leave: int) -> None:
    """Fill folder's filesystem up to `leave` bytes free (a full disk, as another job's files would make it)."""
    free = shutil.disk_usage(folder).free
    with open(folder / "filler", "wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(0, free - leave))
        f.flush()
        os.fsync(f.fileno())


# -- 1. kill -9 at every named moment of a step ------------------------------------------------------------------------
POINTS = ["weights.opened", "weights.renamed", "disk.opened", "disk.renamed", "disk.committed", "weights.committed",
          "engine.closing"]


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_each_moment_of_a_step_resumes_exactly_and_its_files_go(tmp_path, straight, point):
    """--save-every 1, killed at `point` in step 3 (or, engine.closing, while the finished run's engine removes its
    folder); the killed run's engine folder is what a kill leaves at that moment; a resume runs steps 3-5 (or none)
    with the uninterrupted run's losses and weights, and removes it."""
    off, save = tmp_path / "off", tmp_path / "save"
    per_step = {"weights": straight["units"], "disk": straight["blocks"]}
    kind, _, moment = point.partition(".")
    if moment in ("opened", "renamed"):
        nth = per_step[kind] * 3 + 2        # version 0 at setup, steps 1 and 2, then this file of step 3
    elif moment == "committed":
        nth = 3
    else:
        nth = 1

    def train() -> str:
        report = run(job(off, save, save_every=2))
        if point == "engine.closing":
            del report
            gc.collect()
        return "finished"

    said = in_child(train, crash=f"{point}@{nth}")
    assert said == "killed", said
    folder, = engine_folders(off)
    files = sorted(p.name for p in folder.iterdir())
    if point == "engine.closing":
        assert ".lock" in files and len(files) < 2 * (straight["units"] + straight["blocks"]), files
    else:
        manifest = json.loads((folder / MANIFEST).read_text())
        assert manifest["version"] == (3 if point in ("disk.committed", "weights.committed") else 2), point
        assert any(f.startswith("w") and "-v3.bin" in f for f in files), files      # step 3's weights, uncommitted
        if moment == "opened":
            torn = [f for f in files if f.startswith({"weights": "w", "disk": "b"}[kind]) and f.endswith("-v3.bin.tmp")]
            assert any((folder / f).stat().st_size == 0 for f in torn), files       # one just made, still empty
        if point == "weights.committed":
            assert any(f.startswith("w") and "-v2.bin" in f for f in files), files    # the old ones not yet gone
    done = resume_exactly(off, save, straight, at_least=2)
    assert done == (STEPS if point == "engine.closing" else 2)
    assert not folder.exists()                           # found and removed, weights files and *.tmp with it


def test_an_external_kill_9_mid_write_behind_of_sltune_train_resumes_exactly(tmp_path, straight):
    """`sltune train` (the command's entry point, in a child forked from here: no second import of torch) on a disk
    that takes 0.1 s a file is killed with SIGKILL from outside while step 3 writes its weights files: its engine
    folder still names step 2, with step 3's weights files part there; `sltune train --resume` continues with the
    uninterrupted run's losses and weights, and removes the folder."""
    off, save = tmp_path / "off", tmp_path / "save"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                         # pragma: no cover - the child
        gc.freeze()
        os.close(r)
        torch.set_num_threads(1)
        os.environ["SLTUNE_DISK_WRITE_DELAY_S"] = "0.1"
        code = main(["train", *straight["flags"], "--steps", str(STEPS), "--json", "--offload-dir", str(off),
                     "--save", str(save), "--save-every", "2", "--log", str(tmp_path / "killed.jsonl")])
        os.write(w, f"exit {code}".encode())
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + 120
    while not list(off.glob("sltune-r*/w*-v3.bin*")):
        assert os.waitpid(pid, os.WNOHANG) == (0, 0), os.read(r, 1000)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(r)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    folder, = engine_folders(off)
    assert json.loads((folder / MANIFEST).read_text())["version"] == 2     # step 3 was not committed
    assert list(folder.glob("w*-v2.bin")) and list(folder.glob("w*-v3.bin*"))
    killed = [json.loads(line) for line in (tmp_path / "killed.jsonl").read_text().splitlines()]
    assert [s["loss"] for s in killed] == straight["losses"][:2]

    assert main(["train", *straight["flags"], "--steps", str(STEPS), "--offload-dir", str(off), "--save", str(save),
                 "--resume", str(save), "--log", str(tmp_path / "resumed.jsonl")]) == 0
    resumed = [json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert [(s["step"], s["loss"]) for s in resumed] == list(zip(range(3, STEPS + 1), straight["losses"][2:]))
    weights = load_file(save / "model.safetensors")
    assert all(torch.equal(v, straight["weights"][k]) for k, v in weights.items())
    assert not folder.exists()                      # found and removed
    gc.collect()
    assert not engine_folders(off)                  # and the resumed run's own went with its engine


def test_what_dead_engines_left_in_offload_dir_goes_whatever_moment_they_died(tmp_path):
    """A folder a kill left half-removed (no lock file any more), a hidden one a kill left before it was locked
    (older than STALE_S), and a write probe: the next engine removes them; a live engine's folder stays."""
    from sltune.runtime.disk import folder as enginefolder

    off = tmp_path / "off"
    live = SpeedLoaderEngine(build(MODEL, seed=0), SpeedLoaderConfig(**KNOBS, offload_dir=str(off)),
                             optimizer=lambda p: torch.optim.AdamW(p))
    lockless = off / "sltune-r0-999999-0"
    hidden = off / ".sltune-r0-999999-1"
    for folder in (lockless, hidden):
        folder.mkdir()
        (folder / "w0000-embed-v3.bin.tmp").write_bytes(b"x" * 4096)
    probe = off / ".sltune-write-probe-999999"
    probe.write_bytes(b"x")
    old = time.time() - 2 * enginefolder.STALE_S
    os.utime(hidden, (old, old))
    os.utime(probe, (old, old))
    enginefolder.remove_stale(off)
    assert not lockless.exists() and not hidden.exists() and not probe.exists()
    assert live.disk.folder.is_dir()
    del live
    gc.collect()
    assert not engine_folders(off)


# -- 2. a full disk, a read-only or vanished folder ------------------------------------------------------------------
def assert_one_line(said: str, *parts: str) -> None:
    assert said.startswith("error: ") and "\n" not in said, said
    assert "Traceback" not in said and "unexpected" not in said, said
    for part in parts:
        assert part in said, (part, said)


def test_a_full_disk_mid_step_is_one_line_and_the_run_resumes_exactly(tmp_path, straight):
    """offload_dir on a 32 MiB tmpfs another job fills at step 3: the step fails in one line naming the file,
    saying the disk is full and how much is free, and what to do; nothing it wrote is left (no *.tmp, the manifest
    still names step 2), no checkpoint-3 exists, and the run resumes exactly from checkpoint-2."""
    off, save = tmp_path / "off", tmp_path / "save"
    why = namespaces()

    def train() -> str:
        if why is None:
            private_tmpfs(off, 32 << 20)
            at_step(3, lambda: fill(off, 64 << 10))
        else:                   # no namespaces: the file size limit fails a write as a full disk does
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            at_step(3, lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY)))
        try:
            run(job(off, save, save_every=1))
        except OSError as err:
            folder, = (p for p in off.glob("sltune-r*"))
            left = sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp") or "-v3." in p.name)
            version = json.loads((folder / MANIFEST).read_text())["version"]
            raise ValueError(f"{type(err).__name__}: {error_line(err)} [left: {left}, version {version}]") from None
        return "no failure"

    said = in_child(train)
    if why is None:
        assert_one_line(said, "OSError", f"{off}/sltune-r", "offload_dir", f"{off} is full", "MiB free",
                        "--offload-dir", "--resume", "[left: [], version 2]")
    else:
        assert_one_line(said, "OSError", f"{off}/sltune-r", "ulimit -f", "[left: [], version 2]")
    assert not (save / "checkpoint-3").exists()
    assert resume_exactly(tmp_path / "off2", save, straight) == 2


@pytest.mark.parametrize("where", ["first write", "mid-step", "commit"])
def test_after_a_full_disk_the_engine_steps_on_exactly_once_there_is_room(tmp_path, straight, where):
    """The engine's own API: step 3 on a disk left with no room for its first file, for half its files, or for all
    its files but the commit's (optimizer counters and manifest) fails in one line and is rolled back; with the
    space freed, step 3 again and step 4 equal the uninterrupted engine's, bit for bit."""
    if namespaces() is not None:
        pytest.skip(f"a full disk needs a tmpfs of the child's own, and this machine refuses one: {namespaces()}")
    off = tmp_path / "off"
    leave = {"first write": 0, "mid-step": straight["step_bytes"] // 2, "commit": straight["step_bytes"] + 4096}[where]

    def batches(engine):
        rows = engine.config.effective_batch_size
        return [torch.randint(3, 128, (rows, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def losses(folder: Path, full: bool) -> str:
        engine = SpeedLoaderEngine(build(MODEL, seed=0), SpeedLoaderConfig(**KNOBS, offload_dir=str(folder)),
                                   optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
        data, out = batches(engine), []
        for i, x in enumerate(data):
            if full and i == 2:
                fill(folder, leave)
                try:
                    engine.train_step(x)
                    out.append("no failure")
                except OSError as err:
                    out.append(f"failed: {error_line(err)}")
                (folder / "filler").unlink()
            out.append(engine.train_step(x).loss)
        state = engine.state_dict()
        out.append(sum(float(v.double().sum()) for v in state.values()))
        return json.dumps(out)

    def full() -> str:
        private_tmpfs(off, 32 << 20)
        return losses(off, True)

    expected = json.loads(losses(tmp_path / "plain", False))
    said = in_child(full)
    assert said.startswith("done "), said
    got = json.loads(said.removeprefix("done "))
    failure = got.pop(2)
    assert failure.startswith("failed: ") and f"{off} is full" in failure and "\n" not in failure, failure
    assert got == expected, (where, failure)


def test_an_offload_folder_that_is_not_writable_before_training_is_one_line(tmp_path):
    """A file where the folder should be, and (in a namespace) a read-only mount: one line naming offload_dir and
    the fix, before any step."""
    off = tmp_path / "a-file"
    off.write_text("not a folder")
    said = in_child(lambda: run(job(off, None, steps=1)))
    assert_one_line(said, f"offload_dir {off}: not writable", "give a directory")
    if namespaces() is None:
        ro = tmp_path / "ro"
        said = in_child(lambda: (private_tmpfs(ro, 1 << 20, read_only=True), run(job(ro, None, steps=1))))
        assert_one_line(said, f"offload_dir {ro}: not writable (Read-only file system)", "give a directory")


def test_an_offload_folder_made_read_only_mid_run_is_one_line_and_the_run_resumes_exactly(tmp_path, straight):
    """The tmpfs under offload_dir remounted read-only before step 3: one line naming the file, saying the folder is
    no longer writable and the fix; the run resumes exactly from checkpoint-2 on a writable folder."""
    if namespaces() is not None:
        pytest.skip(f"a folder going read-only under a run needs a mount of the child's own (root ignores "
                    f"permissions), and this machine refuses one: {namespaces()}")
    off, save = tmp_path / "off", tmp_path / "save"

    def train() -> None:
        private_tmpfs(off, 32 << 20)
        at_step(3, lambda: remount_read_only(off))
        run(job(off, save, save_every=1))

    said = in_child(train)
    assert_one_line(said, "OSError", f"{off}/sltune-r", f"offload_dir {off} is no longer writable (Read-only file "
                    "system)", "--offload-dir", "--resume")
    assert resume_exactly(tmp_path / "off2", save, straight) == 2


def test_an_offload_folder_removed_mid_run_is_one_line_and_the_run_resumes_exactly(tmp_path, straight):
    """offload_dir removed (rm -r) before step 3: one line saying the engine's folder vanished and the fix, not a
    step on missing files; the run resumes exactly from checkpoint-2."""
    off, save = tmp_path / "off", tmp_path / "save"

    def train() -> None:
        at_step(3, lambda: shutil.rmtree(off))
        run(job(off, save, save_every=1))

    said = in_child(train)
    assert_one_line(said, f"{off}/sltune-r", "vanished while", "--offload-dir", "--resume")
    assert resume_exactly(off, save, straight) == 2


# -- 3. files truncated, or from another model ---------------------------------------------------------------------
def test_a_weights_file_truncated_mid_run_stops_the_run_in_one_line_before_any_nan(tmp_path, straight):
    """A unit's weights file cut short between steps 2 and 3: step 3 fails in one line naming it (never a step on
    what is left of it), the log has steps 1-2 only and no NaN; the run resumes exactly."""
    off, save = tmp_path / "off", tmp_path / "save"

    def truncate() -> None:
        file = sorted(off.glob("sltune-r*/w0001-*-v2.bin"))[0]
        with open(file, "r+b") as f:
            f.truncate(os.path.getsize(file) // 3)

    def train() -> None:
        at_step(3, truncate)
        run(job(off, save, save_every=1, log=str(tmp_path / "log.jsonl")))

    said = in_child(train)
    assert_one_line(said, "IntegrityError", f"{off}/sltune-r", "-v2.bin: the weights of", "unreadable",
                    "--offload-dir")
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [s["step"] for s in logged] == [1, 2] and all(s["loss"] == s["loss"] for s in logged)
    assert resume_exactly(off, save, straight) == 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory, straight):
    """Checkpoints to damage: this run's at step 2, one of the same model trained on other data (files of the
    same sizes, other values), and one of another model (a qwen2: other sizes)."""
    tmp = tmp_path_factory.mktemp("saved")
    run(job(tmp / "off", tmp / "ours", steps=2))
    run(job(tmp / "off", tmp / "seed1", steps=2, seed=1))
    run(job(tmp / "off", tmp / "qwen", steps=2, model=OTHER))
    gc.collect()
    return tmp


STATE = Path("training_state") / "optimizer-rank0-of-1"


@pytest.mark.parametrize("damage", ["block truncated", "block of other data", "state of another model",
                                    "weights truncated", "weights of another model"])
def test_a_damaged_or_foreign_file_is_refused_on_resume_in_one_line_naming_it(tmp_path, straight, saved, capsys,
                                                                              damage):
    """`sltune train --resume` of a checkpoint whose optimizer block (a hard link of the disk tier's file) or weights
    are truncated, or come from another run or model: exit 2, one line naming the file, and no step trained."""
    save = tmp_path / "save"
    shutil.copytree(saved / "ours", save)
    block = next((save / STATE).glob("b00001-v*.bin"))
    if damage == "block truncated":
        named = block
        with open(block, "r+b") as f:
            f.truncate(block.stat().st_size // 2)
    elif damage == "block of other data":
        named = block
        shutil.copy(next((saved / "seed1" / STATE).glob("b00001-v*.bin")), block)
    elif damage == "state of another model":
        named = save / STATE
        shutil.rmtree(save / STATE)
        shutil.copytree(saved / "qwen" / STATE, save / STATE)
    elif damage == "weights truncated":
        named = save / "model.safetensors"
        data = named.read_bytes()
        named.write_bytes(data[:len(data) // 2])
    else:
        named = save / "model.safetensors"
        shutil.copy(saved / "qwen" / "model.safetensors", named)
    log = tmp_path / "log.jsonl"
    code = main(["train", *straight["flags"], "--steps", "4", "--offload-dir", str(tmp_path / "off"), "--resume",
                 str(save), "--log", str(log)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    said = [line for line in lines if "error" in line]      # (a progress bar's last frame may stand above it)
    assert len(said) == 1 and said == lines[-1:] and said[0].startswith("sltune train: error: "), err
    assert str(named) in said[0] and "Traceback" not in err and "unexpected" not in err, err
    assert not log.exists() or not log.read_text()
