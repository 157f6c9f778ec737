"""The training loop `sltune train` runs: a model in, steps with a schedule, clipping, evaluation, metrics and
checkpoints, a Hugging Face folder out; resumable exactly.

Read top to bottom: what the job reads (checked before anything is built), where the weights come from, the data,
the engine, the resume, the loop.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from sltune.config import SpeedLoaderConfig
from sltune.models.checkpoint import TOKENIZER_FILES, read_tokenizer_files
from sltune.training.optimizer import OptimizerConfig
from sltune.training.schedule import LRSchedule, lr_scheduler
from sltune.training import checkpoints
from sltune.training.text import TEXT_SUFFIXES, has_tokenizer, load_tokenizer


@dataclass
class TrainJob:
    """Everything a training run is given (the CLI's flags, a best.yaml's sections)."""

    model: Any                                  # preset name, config.json, dict, or a Hugging Face folder
    config: SpeedLoaderConfig
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    seq_len: int = 128
    steps: int = 20                             # the total: a resumed run runs the rest
    seed: int = 0
    data: str | None = None                     # token ids or text (.txt/.jsonl/.parquet); synthetic when None
    tokenizer: str | None = None                # default: the model folder's own
    holdout: float = 0.0                        # share of the data's rows kept for evaluation
    warmup_steps: int = 0
    lr_schedule: LRSchedule = "constant"
    min_lr: float = 0.0
    max_grad_norm: float | None = None
    eval_every: int | None = None
    log: str | None = None                      # a JSON line per step
    save: str | None = None                     # the Hugging Face folder written at the end
    save_every: int | None = None               # ...and checkpoint-{step} folders in it every N steps
    keep: int = 3
    save_dtype: str | None = None
    max_shard_size: str | int = "5GB"
    resume: str | None = None
    overwrite: bool = False                     # a fresh run may replace the checkpoints in --save

    def __post_init__(self) -> None:
        _check(self)            # at construction: the CLI refuses a bad flag before its progress bar starts


@dataclass(frozen=True)
class Inputs:
    """What a job reads besides its weights, found and checked before anything is built (a wrong path is one line
    before the model loads, not an error under a 0% bar)."""

    resumed: Path | None                        # the checkpoint --resume continues from
    trainer: dict[str, Any] | None              # ... and its training state
    source: Path | None                         # the folder the weights come from: the resumed one, or --model's
    tokenizer: Path | None                      # the folder text --data is tokenized with
    tokenizer_files: dict[str, bytes]           # the run's tokenizer, held from the start: every saved folder gets it
    tokens: torch.Tensor | None                 # --data's ids; None: synthetic
    lock: Any = None                            # rank 0's hold on --save's lock (state.hold): released by run()

    def release(self) -> None:
        """Let go of the --save folder's lock (run() does, at its end; idempotent)."""
        if self.lock is not None:
            self.lock.release()


TOKEN_SUFFIXES = (".npy", ".pt", ".bin")      # what sltune.training.data.load_tokens reads besides text


def find_inputs(job: TrainJob) -> Inputs:
    """--data, --resume, --save and the tokenizer, checked and read, cheapest first: the data file, the --save
    folder's lock (rank 0 holds it for the whole run: a second run on the folder is refused), the checkpoint to
    resume (what a dead run left finished or removed, verified, and the steps it leaves), --model's folder, whose
    checkpoints --save holds, the tokenizer text needs, then the ids. Under several ranks this runs before the
    process group: rank 0 recovers and picks the checkpoint, the other ranks only look (run() then loads the one
    rank 0 picked on every rank, state.agree)."""
    from sltune.training.data import load_tokens

    if job.data:
        _check_data_file(Path(job.data))
    first = os.environ.get("RANK", "0") == "0"
    lock = checkpoints.hold(job.save) if job.save and first else None
    try:
        resumed, trainer = None, None
        if job.resume and first:        # the steps left are those of the checkpoint the resume would continue
            resumed, trainer = checkpoints.latest(job.resume)
            saved_by = trainer.get("backend", "speedloader")
            if saved_by != job.config.backend:
                raise ValueError(f"--resume {job.resume}: saved by a {saved_by} run and this run's backend is "
                                 f"{job.config.backend}; resume with the config it trained with (backend {saved_by}), "
                                 f"or start a new run from its weights with --model {resumed}")
            if int(trainer["step"]) >= job.steps:
                raise ValueError(f"--resume {job.resume}: the checkpoint is at step {trainer['step']} ({resumed}), "
                                 f"and --steps {job.steps} is the total; pass a larger --steps to train on")
        elif job.resume:                # a look, not a pick: rank 0 may be finishing a dead run's save meanwhile
            try:
                resumed, trainer = checkpoints.latest(job.resume, warn=lambda _: None, recovered=False,
                                                      checksums=False)
            except (ValueError, OSError):
                pass
        source = resumed or (Path(job.model) if _is_folder(job.model) else None)
        if first and resumed is None and source is not None:
            checkpoints.check_model_folder(source)
        if job.save and first:
            checkpoints.check_save_folder(job.save, trainer.get("run") if trainer else None, resumed, job.overwrite)
        tokenizer = Path(job.tokenizer) if job.tokenizer else source
        if job.data and Path(job.data).suffix in TEXT_SUFFIXES:
            _check_text_tokenizer(job, tokenizer, resumed)
        return Inputs(resumed=resumed, trainer=trainer, source=source, tokenizer=tokenizer,
                      tokenizer_files=read_tokenizer_files(tokenizer),
                      tokens=load_tokens(job.data, tokenizer) if job.data else None, lock=lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _check_data_file(path: Path) -> None:
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file; give token ids (.npy, .pt or uint16 .bin) or text (.txt, "
                         f".jsonl or .parquet), or omit --data to train on synthetic tokens")
    if path.suffix not in (*TOKEN_SUFFIXES, *TEXT_SUFFIXES):
        raise ValueError(f"--data {path}: use token ids (.npy, .pt or uint16 .bin) or text (.txt, .jsonl or "
                         f".parquet, with --tokenizer)")


def _check_text_tokenizer(job: TrainJob, tokenizer: Path | None, resumed: Path | None) -> None:
    """Text --data needs a tokenizer: --tokenizer (tokenizing names it in a mistake), else the one saved in the
    weights' folder, named here as the flag that gave that folder."""
    if job.tokenizer:
        return
    fix = "pass --tokenizer FOLDER (a Hugging Face tokenizer saved with save_pretrained) to tokenize it"
    if tokenizer is None:
        raise ValueError(f"--data {job.data} is text: {fix}")
    named = f"--resume {job.resume} (its checkpoint {tokenizer})" if resumed is not None else f"--model {tokenizer}"
    if not has_tokenizer(tokenizer):
        raise ValueError(f"--data {job.data} is text and {named} has no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, "
                         f"...); {fix}")
    try:
        load_tokenizer(tokenizer, named=f"the tokenizer of {named}")
    except ValueError as err:
        raise ValueError(f"{err}; or {fix}") from None


@dataclass
class TrainReport:
    steps: list[dict[str, Any]]                 # the metrics of each step this run took
    evals: list[dict[str, Any]]
    first_step: int                             # 1, or the step after the resumed checkpoint's
    engine: Any
    saved: str | None
    wall_seconds: float


def run(job: TrainJob, rank: int = 0, world: int = 1, progress: Callable[[dict[str, Any]], None] | None = None,
        inputs: Inputs | None = None) -> TrainReport:
    """Train `job`; `inputs` are find_inputs(job), found here when the caller has not checked them already (the
    --save folder's lock they hold is released at the end)."""
    start = time.perf_counter()
    inputs = inputs if inputs is not None else find_inputs(job)
    try:
        return _run(job, rank, world, progress, inputs, start)
    finally:
        inputs.release()


def _run(job: TrainJob, rank: int, world: int, progress: Callable[[dict[str, Any]], None] | None, inputs: Inputs,
         start: float) -> TrainReport:
    from sltune import SpeedLoaderEngine
    from sltune.training.data import TokenBatches
    from sltune.models import build
    from sltune.models.checkpoint import Checkpoint

    # where the weights come from: a resumed checkpoint (the one rank 0 picked, on every rank), a Hugging Face
    # folder, or a preset with random weights
    resumed, trainer = checkpoints.agree(inputs.resumed, inputs.trainer)
    source = resumed if resumed is not None else inputs.source
    checkpoint = Checkpoint(source) if source is not None else None
    exact = checkpoints.exact_weights(resumed) if resumed is not None else None
    if exact is not None and job.config.backend == "speedloader":
        checkpoint.use_weights(exact)
    engine_kwargs = dict(max_grad_norm=job.max_grad_norm, track_grad_norm=True)
    if job.config.backend != "speedloader":     # DeepSpeed or FSDP2, stepping as its trials did (training.wrapped)
        from sltune.training.wrapped import BackendEngine

        engine = BackendEngine(job.config, source if source is not None else job.model, job.optimizer, seed=job.seed,
                               max_grad_norm=job.max_grad_norm, exact_weights=exact)
        model = engine.model
    elif checkpoint is not None and checkpoint.has_weights:
        model = checkpoint.empty_model()
        engine = SpeedLoaderEngine(model, job.config, optimizer=job.optimizer.factory, weights=checkpoint,
                                   **engine_kwargs)
    else:
        model = build(checkpoint.config if checkpoint is not None else job.model, seed=job.seed)
        engine = SpeedLoaderEngine(model, job.config, optimizer=job.optimizer.factory, **engine_kwargs)
    model.train()
    vocab = model.config.vocab_size
    save_dtype = _save_dtype(job, trainer, checkpoint, engine)

    # the data: every rank the same stream and seed, each its own rows of a step
    data = TokenBatches(job.config.effective_batch_size, job.seq_len, vocab, inputs.tokens, seed=job.seed,
                        holdout=job.holdout, rank=rank, world=world)
    held_out = data.eval_batches(job.config.effective_batch_size, drop_last=True) if job.eval_every else []
    if job.eval_every and not held_out:
        raise ValueError(f"--eval-every needs held-out rows: --holdout {job.holdout} keeps {data.eval_rows}, fewer "
                         f"than one batch of {job.config.effective_batch_size}; raise --holdout")

    done = 0
    if trainer is not None:
        done = int(trainer["step"])
        checkpoints.restore(resumed, trainer, engine)
        data.load_state_dict(trainer["data"])
    run_id, owner = _run_identity(trainer, world)     # a resumed run keeps its id: its checkpoints are one run's
    if job.overwrite:               # (find_inputs finished or removed what a dead run left, under the lock)
        checkpoints.together(lambda: checkpoints.remove_old_checkpoints(job.save, keep=resumed, owner=owner)
                             if rank == 0 else None)
    scheduler = lr_scheduler(engine.optimizer, job.lr_schedule, job.warmup_steps, job.steps, job.min_lr, done)

    log = open(job.log, "a") if job.log and rank == 0 else None
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []

    def save(path: Path, step: int, periodic: bool) -> None:
        state = {"step": step, "run": run_id, "data": data.state_dict()}
        if job.config.backend != "speedloader":     # a resume checks it trains the same way
            state["backend"] = job.config.backend
        checkpoints.save_checkpoint(path, engine, state, save_dtype, job.max_shard_size, inputs.tokenizer_files,
                                    owner=owner, periodic=periodic)

    try:
        for step in range(done + 1, job.steps + 1):
            lr = engine.optimizer.param_groups[0]["lr"]
            res = engine.train_step(next(data))
            scheduler.step()
            line = {"step": step, "loss": res.loss, "lr": lr, "grad_norm": res.grad_norm,
                    "tokens_per_s": res.tokens * world / res.seconds, "loss_scale": res.loss_scale,
                    "skipped": res.skipped, "seconds": res.seconds}
            if job.eval_every and (step % job.eval_every == 0 or step == job.steps):
                line["eval_loss"] = sum(engine.evaluate(b) for b in held_out) / len(held_out)
                evals.append({"step": step, "eval_loss": line["eval_loss"]})
            steps.append({**line, "io": res.io, "peak_device_bytes": res.peak_device_bytes})
            if log is not None:
                log.write(json.dumps(line) + "\n")
                log.flush()
            if progress is not None:
                progress(line)
            if job.save and job.save_every and step % job.save_every == 0 and step < job.steps:
                save(Path(job.save) / f"checkpoint-{step}", step, periodic=True)
                checkpoints.together(lambda: checkpoints.prune(job.save, job.keep, step, run_id, owner)
                                     if rank == 0 else None)   # after the new one is complete; this run's only
        if job.save:
            save(Path(job.save), job.steps, periodic=False)
            if job.config.backend == "deepspeed":       # nothing resumes it: no resume state left to suggest one
                checkpoints.together(lambda: checkpoints.drop_resume_state(job.save, run_id, owner)
                                     if rank == 0 else None)
    finally:
        if log is not None:
            log.close()
    return TrainReport(steps=steps, evals=evals, first_step=done + 1, engine=engine, saved=job.save,
                       wall_seconds=time.perf_counter() - start)


def _run_identity(trainer: dict[str, Any] | None, world: int) -> tuple[str, int]:
    """The run's id (the resumed checkpoint's, else a new one) and rank 0's pid, which names the folders a save
    writes aside: the same on every rank."""
    agreed = [(trainer or {}).get("run") or checkpoints.new_run_id(), os.getpid()]
    if world > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(agreed, src=0)
    return str(agreed[0]), int(agreed[1])


def _is_folder(model: Any) -> bool:
    return isinstance(model, (str, Path)) and Path(model).is_dir()


def _save_dtype(job: TrainJob, trainer: dict[str, Any] | None, checkpoint, engine) -> torch.dtype:
    """--save-dtype, else what the run started from saved (on resume), else a deepspeed run's compute dtype (its
    model holds no more: the float32 masters stay in ZeRO's optimizer, so a float32 file would only widen bfloat16
    values), else the source checkpoint's dtype, else the weights as stepped (float32 masters under mixed
    precision)."""
    if job.save_dtype:
        return getattr(torch, job.save_dtype)
    if trainer is not None:
        return getattr(torch, trainer["save_dtype"])
    if job.config.backend == "deepspeed":
        return engine.stepped_dtype
    if checkpoint is not None and checkpoint.has_weights and checkpoint.dtype is not None:
        return checkpoint.dtype
    if getattr(engine, "stepped_dtype", None) is not None:     # a wrapped backend's (training.wrapped)
        return engine.stepped_dtype
    return torch.float32 if engine.params.master else engine.dtype


def _check(job: TrainJob) -> None:
    """The flags' own ranges, each named with its fix, before anything is built."""
    if job.steps < 1:
        raise ValueError(f"--steps must be >= 1 (the total, resumed steps included), got {job.steps}")
    if job.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2 (a next-token loss needs two tokens), got {job.seq_len}")
    if job.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {job.seed}")
    if job.max_grad_norm is not None and not job.max_grad_norm > 0:
        raise ValueError(f"--max-grad-norm must be > 0 (omit it to not clip), got {job.max_grad_norm}")
    for flag, value in (("--eval-every", job.eval_every), ("--save-every", job.save_every)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1 (omit it to never), got {value}")
    if job.keep < 1:
        raise ValueError(f"--keep must be >= 1, got {job.keep}")
    if job.save_every and not job.save:
        raise ValueError("--save-every writes checkpoint-N folders inside --save DIR; pass --save DIR too")
    if job.overwrite and not job.save:
        raise ValueError("--overwrite replaces the checkpoints in --save DIR; pass --save DIR too")
    if job.save_dtype is not None and job.save_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--save-dtype {job.save_dtype!r}: use float32, bfloat16 or float16")
    if job.eval_every and job.holdout == 0:
        raise ValueError("--eval-every evaluates on held-out rows: pass --holdout (e.g. 0.05) to keep some")
    if job.resume and job.config.backend == "deepspeed":
        raise ValueError(f"--resume {job.resume}: a deepspeed run cannot resume exactly (its optimizer state lives in "
                         "ZeRO's partitions, which sltune's checkpoints do not hold); start a new run from the saved "
                         f"weights with --model {job.resume}, or train with backend fsdp or speedloader to resume")
