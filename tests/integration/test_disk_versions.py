"""disk_versions 1 (#34, item 4): the disk tier keeps one version of the optimizer's files, each old file deleted as
soon as its new one is renamed into place, the last checkpoint being the recovery point. Training equals
disk_versions 2 bit for bit; the folder's measured peak is one version and the window's blocks in flight instead of
two versions; a step failing after it deleted an old file tears the engine (every later step, save or read of a
master is one line saying to resume, and the folder is unreadable in one line) while a checkpoint taken before
stays whole and resumes exactly; a kill -9 right after a deletion resumes exactly from the last checkpoint; a bad
value is one line naming the field. The prior (and `sltune plan --disk-versions 1`) predicts about half the disk."""

from __future__ import annotations

import contextlib
import json
import pathlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from sltune import SpeedLoaderConfig, SpeedLoaderEngine
from sltune.cli.main import error_line, main
from sltune.models import build
from sltune.runtime.disk.layout import DEPTH, padded
from sltune.runtime.disk.files import MANIFEST, TORN, IntegrityError, TornError, read_committed
from sltune.settings import Settings
from sltune.training import checkpoints
from sltune.training.loop import TrainJob, run
from sltune.tuning.cost.prior import predict
from sltune.tuning.cost.setup import Setup
from sltune.tuning.cost.shape import shape_of
from sltune.tuning.report.plan_from_prior import plan_spec
from sltune.tuning.space import Candidate
from tests.support.children import in_child
from tests.support.reference import adamw
from tests.support.runtime import one_thread  # noqa: F401 - a module-wide fixture: one intra-op thread

SEQ, STEPS = 16, 4
# built from configs (as tests/integration/test_param_offload_crash.py's): a step in tens of milliseconds
MODEL = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}
DEEP = {**MODEL, "num_hidden_layers": 16}       # 18 blocks: the window's 3 are a small part of a version


def train(versions: int, folder: Path, preset: Any = "llama-tiny", steps: int = 3, clip: float | None = None,
          **knobs: Any) -> tuple[SpeedLoaderEngine, list]:
    knobs = {"sub_batch_size": 2, "num_sub_batches": 2, "num_live_blocks": 1, "dtype": "bfloat16", **knobs}
    cfg = SpeedLoaderConfig(**knobs, optimizer_offload="disk", offload_dir=str(folder), disk_versions=versions)
    engine = SpeedLoaderEngine(build(preset, seed=0), cfg, optimizer=adamw, max_grad_norm=clip, track_grad_norm=True)
    return engine, [engine.train_step(x) for x in batches(cfg.effective_batch_size, steps)]


def batches(rows: int, steps: int) -> list[torch.Tensor]:
    return [torch.randint(3, 128, (rows, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(steps)]


def block_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("b*.bin*"))


# -- the same training --------------------------------------------------------------------------------------------
CASES = {
    "bf16-mixed": {},                                   # stepped during the backward
    "bf16-clipping": dict(clip=0.05),                   # stepped after the backward, every gradient first
    "float32": dict(dtype="float32"),                   # no master: the state alone on disk
    "weights-on-disk": dict(param_offload="disk"),      # the weights files drop their old copies too
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_one_version_trains_as_two_bit_for_bit(tmp_path, case):
    (two, a), (one, b) = train(2, tmp_path / "two", **case), train(1, tmp_path / "one", **case)
    assert [(r.loss, r.grad_norm) for r in a] == [(r.loss, r.grad_norm) for r in b]
    ours, theirs = two.state_dict(), one.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for p, q in zip(two.model.parameters(), one.model.parameters()):       # the dtype copies the device loads
        assert torch.equal(p.data, q.data)
    x, y = read_committed(two.disk.folder), read_committed(one.disk.folder)
    assert x["version"] == y["version"] == 3 and x["tensors"].keys() == y["tensors"].keys()
    for index, tensors in x["tensors"].items():
        assert all(torch.equal(t, y["tensors"][index][key]) for key, t in tensors.items()), index
    # between steps the folder holds the committed version alone, its manifest in place
    assert block_files(one.disk.folder) == sorted(b.file for b in one.disk.blocks)
    assert not (one.disk.folder / TORN).exists()
    if case.get("param_offload") == "disk":
        assert sorted(p.name for p in one.disk.folder.glob("w*.bin*")) == \
            sorted(name for name, _, _ in one.weights.committed)
    assert b[-1].io == a[-1].io                         # the same traffic: only when the old files go differs


# -- the disk it takes, measured ----------------------------------------------------------------------------------
@contextlib.contextmanager
def folder_peak(folder: Path):
    """The largest total size of the folder's files while the block runs: measured just before every file in it is
    deleted (the only moments the total falls, so its maxima) and by a thread sampling it every millisecond."""
    peak = {"bytes": 0}
    real_unlink = pathlib.Path.unlink

    def size() -> int:
        total = 0
        for p in list(folder.iterdir()):
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        return total

    def note() -> None:
        n = size()
        peak["bytes"] = max(peak["bytes"], n)

    def unlink(self, *args, **kwargs):
        if self.parent == folder:
            note()
        return real_unlink(self, *args, **kwargs)

    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            note()
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    pathlib.Path.unlink = unlink
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()
        pathlib.Path.unlink = real_unlink


@pytest.mark.parametrize("param_offload", ["host", "disk"])
def test_the_folders_peak_is_one_version_and_the_window_instead_of_two_versions(tmp_path, param_offload):
    measured = {}
    for versions in (2, 1):
        engine, _ = train(versions, tmp_path / f"v{versions}", preset=DEEP, steps=1, param_offload=param_offload)
        disk = engine.disk
        version = sum(padded(disk.nbytes(b, True)) for b in disk.blocks)       # master and AdamW's moments
        window = sum(sorted((padded(disk.nbytes(b, True)) for b in disk.blocks), reverse=True)[:DEPTH])
        units = [padded(n) for _, n, _ in engine.weights.committed] if engine.weights else [0]
        weights, largest_unit = sum(units), max(units)
        rest = sum(p.stat().st_size for p in disk.folder.iterdir()) - version - weights   # manifest, counters
        rest += 4096            # ... which grow by a few bytes as the step counts and sums they hold change
        with folder_peak(disk.folder) as peak:
            for x in batches(4, 3):             # steps 2-4: every file full size (step 1 had masters alone)
                engine.train_step(x)
        measured[versions] = peak["bytes"]
        if versions == 2:       # the new version written whole beside the committed one
            assert 2 * (version + weights) <= peak["bytes"] <= 2 * (version + weights + rest)
        else:                   # one version, and at most the window's blocks (and a weights file) in flight
            assert version + weights <= peak["bytes"] <= version + weights + window + largest_unit + 2 * rest
        assert len(disk.blocks) == 18 and window < version / 4
    assert measured[1] < 0.7 * measured[2], measured


def test_the_prior_and_plan_predict_one_version_and_the_window(tmp_path, monkeypatch):
    shape = shape_of("llama-tiny", "bfloat16")
    on_disk = Candidate(1, 1, 1, optimizer_offload="disk")
    two = predict(Setup("llama-tiny", shape, seq_len=32), on_disk)
    one = predict(Setup("llama-tiny", shape, seq_len=32, disk_versions=1), on_disk)
    files = dict(two.disk_terms)["the committed version's files"]
    assert two.disk == 2 * files and dict(one.disk_terms)["the committed version's files"] == files
    window = dict(one.host_terms)[f"the disk tier's window ({DEPTH} blocks' master and state)"]
    assert one.disk == files + window and one.disk < two.disk
    assert one.disk_read == two.disk_read == files                  # the same traffic
    # sltune plan SPEC --disk-versions 1: the 7B's disk need about halves
    from sltune.tuning.cost import feasible

    monkeypatch.setattr(feasible, "free_bytes", lambda folder: 2**40)
    spec = {"name": "7b", "model": {"preset": "llama-2-7b", "dtype": "bfloat16"}, "workload": {"seq_len": 128},
            "search": {"sub_batch_size": [1], "num_sub_batches": [1], "num_live_blocks": [1],
                       "optimizer_offload": ["disk"]}}
    need = {v: plan_spec(spec, "7b.yaml", settings=Settings(data_dir=tmp_path), disk_versions=v)["configs"][0]
            ["peak_disk_bytes"] for v in (1, 2)}
    assert 0.5 < need[1] / need[2] < 0.52, need


# -- a step that fails ------------------------------------------------------------------------------------------
def job(off: Path, save: Path | None, versions: int = 1, steps: int = STEPS, **kw: Any) -> TrainJob:
    cfg = SpeedLoaderConfig(sub_batch_size=1, num_sub_batches=2, num_live_blocks=1, dtype="bfloat16",
                            optimizer_offload="disk", offload_dir=str(off), disk_versions=versions,
                            param_offload=kw.pop("param_offload", "host"))
    return TrainJob(model=MODEL, config=cfg, seq_len=SEQ, steps=steps, save=str(save) if save else None,
                    **{k: str(v) if k == "resume" else v for k, v in kw.items()})


_straight: dict[str, dict[str, Any]] = {}


def straight(tmp_path: Path, param_offload: str = "host") -> dict[str, Any]:
    """An uninterrupted run under disk_versions 2: its losses and final weights (once per weights' place)."""
    if param_offload not in _straight:
        report = run(job(tmp_path / "straight-off", tmp_path / "straight", versions=2, param_offload=param_offload))
        _straight[param_offload] = {
            "losses": [s["loss"] for s in report.steps], "blocks": len(report.engine.disk.blocks),
            "units": len(report.engine.weights.committed) if report.engine.weights else 0,
            "weights": load_file(tmp_path / "straight" / "model.safetensors")}
    return _straight[param_offload]


def resume_exactly(off: Path, save: Path, expected: dict[str, Any], param_offload: str = "host") -> int:
    """Resume `save` to STEPS under disk_versions 1: the uninterrupted run's losses and weights, bit for bit."""
    done = int(checkpoints.latest(save, warn=lambda _: None)[1]["step"])
    report = run(job(off, save, resume=save, param_offload=param_offload))
    assert [s["loss"] for s in report.steps] == expected["losses"][done:], done
    weights = load_file(save / "model.safetensors")
    assert weights.keys() == expected["weights"].keys()
    assert all(torch.equal(v, expected["weights"][k]) for k, v in weights.items())
    return done


@contextlib.contextmanager
def optimizer_failing(engines: list, when, message: str = "injected"):
    """AdamW.step raises when `when(engine, calls)` says so (calls: this step's so far); every engine that trains
    meanwhile is appended to `engines`."""
    real_step, real_train = torch.optim.AdamW.step, SpeedLoaderEngine.train_step
    calls = {"n": 0}

    def train_step(self, *args, **kwargs):
        engines.append(self)
        calls["n"] = 0
        return real_train(self, *args, **kwargs)

    def step(self, *args, **kwargs):
        calls["n"] += 1
        if engines and when(engines[-1], calls["n"]):
            raise RuntimeError(message)
        return real_step(self, *args, **kwargs)

    torch.optim.AdamW.step, SpeedLoaderEngine.train_step = step, train_step
    try:
        yield
    finally:
        torch.optim.AdamW.step, SpeedLoaderEngine.train_step = real_step, real_train


def after_a_drop(engine, n: int) -> bool:
    """Step 3's second block, once the first one's old file is gone."""
    if engine.disk.version != 2 or n != 2:
        return False
    deadline = time.monotonic() + 30
    while not engine.disk.dropped and time.monotonic() < deadline:
        time.sleep(0.001)
    assert engine.disk.dropped
    return True


def test_a_step_failing_after_a_drop_tears_the_engine_and_the_checkpoint_before_resumes_exactly(tmp_path):
    expected = straight(tmp_path)
    off, save, engines = tmp_path / "off", tmp_path / "save", []
    with optimizer_failing(engines, after_a_drop), pytest.raises(RuntimeError, match="injected"):
        run(job(off, save, save_every=1))
    engine = engines[-1]
    folder = engine.disk.folder
    assert engine.disk.torn is not None and engine.disk.version == 2
    # nothing half-claimed: no block file of either version, no *.tmp; the manifest set aside
    assert block_files(folder) == [] and not (folder / MANIFEST).exists() and (folder / TORN).exists()
    # the engine: one line, what happened and the fix, for a step, a checkpoint, a master's read;
    x = batches(2, 1)[0]
    # an evaluation or a generation too: the weights are partly stepped
    for attempt in (lambda: engine.train_step(x), engine.state_dict, lambda: engine.evaluate(x),
                    lambda: engine.generate(x[:, :4], max_new_tokens=1),
                    lambda: engine.disk.link_into(tmp_path / "link", engine.optimizer.state_dict())):
        with pytest.raises(TornError) as err:
            attempt()
        line = error_line(err.value)
        assert str(folder) in line and "a step failed mid-way under disk_versions 1" in line, line
        assert "resume from the last checkpoint with --resume, or use disk_versions: 2" in line, line
    assert not (tmp_path / "link").exists()
    # the folder: one IntegrityError line naming it
    with pytest.raises(IntegrityError, match=r"a step failed \(or was killed\) mid-way under disk_versions 1.*"
                                             r"resume from the last checkpoint \(--resume\)") as err:
        read_committed(folder)
    assert str(folder) in str(err.value)
    # checkpoint-2 (hard links to the files step 3 deleted from the folder) is whole, and resumes exactly
    checkpoints.verify(save / "checkpoint-2")
    assert resume_exactly(tmp_path / "off2", save, expected) == 2


def test_a_step_failing_before_any_drop_rolls_back_as_under_two_versions(tmp_path):
    """The optimizer raises on step 2's first block: no block written, no old file deleted; the step rolls back,
    the engine steps on, and equals an uninterrupted disk_versions 2 run."""
    engine, _ = train(1, tmp_path / "one", steps=1)
    engines = []
    x = batches(4, 2)[1]
    with optimizer_failing(engines, lambda e, n: e is engine and n == 1), pytest.raises(RuntimeError):
        engine.train_step(x)
    assert engine.disk.torn is None and engine.disk.version == 1
    assert block_files(engine.disk.folder) == sorted(b.file for b in engine.disk.blocks)
    assert read_committed(engine.disk.folder)["version"] == 1
    engine.train_step(x)
    two, _ = train(2, tmp_path / "two", steps=2)
    assert all(torch.equal(v, two.state_dict()[k]) for k, v in engine.state_dict().items())


# -- kill -9 -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("point", ["disk.dropped", "weights.dropped"])
def test_a_kill_right_after_a_drop_resumes_exactly_from_the_last_checkpoint(tmp_path, point):
    """Killed in step 3 right after its second old file went (a block's, or a weights file's under param_offload
    disk): the dead engine's folder has no complete version and says so; --resume from checkpoint-2 gives the
    uninterrupted run's losses and weights, and removes that folder."""
    param_offload = "disk" if point.startswith("weights") else "host"
    expected = straight(tmp_path, param_offload)
    off, save = tmp_path / "off", tmp_path / "save"
    per_step = expected["units"] if point.startswith("weights") else expected["blocks"]      # files dropped a step

    def train_run() -> None:
        run(job(off, save, save_every=2, param_offload=param_offload))

    said = in_child(train_run, crash=f"{point}@{2 * per_step + 2}")
    assert said == "killed", said
    folder, = off.glob("sltune-r*")
    assert (folder / TORN).exists() and not (folder / MANIFEST).exists()
    with pytest.raises(TornError, match="resume from the last checkpoint"):
        read_committed(folder)
    assert resume_exactly(off, save, expected, param_offload) == 2
    assert not folder.exists()                  # the dead engine's folder, removed as stale


# -- bad input ----------------------------------------------------------------------------------------------------
def test_a_bad_disk_versions_is_one_line_naming_the_field(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^config: disk_versions: Input should be 1 or 2$"):
        SpeedLoaderConfig.from_dict({"optimizer_offload": "disk", "offload_dir": str(tmp_path), "disk_versions": 3})
    with pytest.raises(ValueError, match="disk_versions"):
        SpeedLoaderConfig(disk_versions=3)
    base = ["train", "--model", "llama-tiny", "--steps", "1", "--seq-len", "8"]
    with pytest.raises(SystemExit) as done:     # argparse's refusal: the flag's choices come from the field's Literal
        main([*base, "--optimizer-offload", "disk", "--offload-dir", str(tmp_path), "--disk-versions", "3"])
    assert done.value.code == 2
    assert capsys.readouterr().err.endswith("error: argument --disk-versions: invalid choice: 3 (choose from 1, 2); "
                                            "see `sltune train -h`\n")
    assert main([*base, "--disk-versions", "1"]) == 2
    assert "--disk-versions: it counts the versions of --optimizer-offload disk's files" in capsys.readouterr().err
    # the default leaves best.yaml as it was; 1 is written
    assert "disk_versions" not in SpeedLoaderConfig().to_dict()
    assert SpeedLoaderConfig(optimizer_offload="disk", offload_dir="x", disk_versions=1).to_dict()["disk_versions"] == 1


def test_a_profile_trial_runs_with_one_version_and_says_so(tmp_path, capsys):
    """`sltune profile --disk-versions 1`: the trial's engine keeps one version (its result's config says so; the
    default's reads as before), and the flag alone is one line naming the fix."""
    base = ["profile", "--model", "llama-tiny", "--dtype", "bfloat16", "--seq-len", "16", "--steps", "1",
            "--no-profile", "--json", "--optimizer-offload", "disk", "--offload-dir", str(tmp_path)]
    assert main([*base, "--disk-versions", "1"]) == 0
    one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert one["status"] == "ok" and one["config"]["disk_versions"] == 1 and one["parity"]["ok"]
    assert main(base) == 0
    assert "disk_versions" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["config"]
    assert main(["profile", "--model", "llama-tiny", "--steps", "1", "--disk-versions", "1"]) == 2
    assert "--disk-versions: it counts the versions of --optimizer-offload disk's files" in capsys.readouterr().err
    # what the trial process builds from its spec (sltune.profiling.child) keeps one version
    from sltune.backends import build as build_backend
    from sltune.backends.base import TrainingSpec
    from sltune.profiling.schema import TrialSpec

    spec = TrialSpec(model="llama-tiny", dtype="bfloat16", optimizer_offload="disk", offload_dir=str(tmp_path),
                     disk_versions=1)
    assert build_backend("speedloader", TrainingSpec.of(spec)).engine.disk.versions == 1
