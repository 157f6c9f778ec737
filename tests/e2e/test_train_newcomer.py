"""What a new user hit with `sltune train`, each as a real `sltune train` process: a resume in place after a crash
keeps the tokenizer in every folder it saves; a missing --data, --tokenizer or --resume is one line before the
model loads; a --device-memory-limit nothing fits is refused before the step with the prior's minimum; and under
torchrun a world-size mismatch is said once, by rank 0, before torchrun's own failure text."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli import sltune
from tests.support.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")
TEXT = " ".join(f"the quick brown fox {n} jumps over the lazy dog and lands in paragraph {n % 7}."
                for n in range(400))
SMALL = ["--seq-len", "16", "--sub-batch-size", "1", "--num-sub-batches", "1", "--num-live-blocks", "1"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """llama-tiny saved as transformers saves it, with a byte-level BPE tokenizer of 300 ids beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sltune.models import build

    folder = tmp_path_factory.mktemp("model")
    build("llama-tiny", seed=1).save_pretrained(folder)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(TEXT)
    return path


def saved_folders(save: Path) -> list[Path]:
    """The folders a run wrote: the final --save (when it got that far) and every checkpoint-N."""
    return [f for f in [save, *sorted(save.glob("checkpoint-*"))] if (f / "config.json").is_file()]


def assert_has_the_tokenizer(folder: Path, model: Path) -> None:
    from transformers import AutoTokenizer

    for name in TOKENIZER:
        assert (folder / name).is_file(), f"{folder} has no {name}: {sorted(p.name for p in folder.iterdir())}"
        assert (folder / name).read_bytes() == (model / name).read_bytes(), (folder, name)
    assert AutoTokenizer.from_pretrained(str(folder)).eos_token == "</s>"


def one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    err = out.stderr
    assert err.count("\n") == 1 and err.startswith("sltune train: error: "), err
    assert "Traceback" not in err and "step/s" not in err and "%|" not in err      # no bar was drawn
    return err


# -- 1. resuming keeps the tokenizer --------------------------------------------------------------------------
def test_resuming_from_a_checkpoint_into_the_same_folder_keeps_the_tokenizer_in_every_saved_folder(
        tmp_path, model, corpus):
    """`--resume rp2/checkpoint-3 --save rp2 --keep 1`: the next checkpoint prunes checkpoint-3, the folder the
    tokenizer used to be copied from; the checkpoints after it (and the final folder) must still have it."""
    save = tmp_path / "rp2"
    common = ["train", "--model", str(model), "--data", str(corpus), *SMALL, "--save-every", "1", "--keep", "1",
              "--save", str(save), "--json"]
    first = sltune(*common, "--steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    again = sltune(*common, "--steps", "7", "--resume", str(save / "checkpoint-3"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in save.glob("checkpoint-*")) == ["checkpoint-6"]
    for folder in saved_folders(save):
        assert_has_the_tokenizer(folder, model)


def test_resuming_in_place_after_kill_9_keeps_the_tokenizer_in_every_saved_folder(tmp_path, model, corpus):
    """The new user's path: `train ... --save killed`, kill -9 mid-run, `train ... --save killed --resume killed`.
    `killed/` then loads with AutoTokenizer, as does every checkpoint."""
    save = tmp_path / "killed"
    common = ["train", "--model", str(model), "--data", str(corpus), *SMALL, "--save-every", "2", "--keep", "1",
              "--save", str(save), "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "sltune", *common, "--steps", "100000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list(save.glob("checkpoint-*/training_state/trainer.pt")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    proc.stderr.close()
    assert not (save / "config.json").exists()                  # killed before the final save
    done = max(int(p.parent.parent.name.split("-")[1]) for p in save.glob("checkpoint-*/training_state/trainer.pt"))
    out = sltune(*common, "--steps", str(done + 5), "--resume", str(save))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (save / "config.json").is_file() and len(list(save.glob("checkpoint-*"))) == 1
    for folder in saved_folders(save):
        assert_has_the_tokenizer(folder, model)


# -- 2. the inputs are checked before the model loads ----------------------------------------------------------
@pytest.fixture(scope="module")
def unloadable(tmp_path_factory) -> Path:
    """A model folder whose weights cannot be read: any error about the inputs must come before this one."""
    from sltune.models import build

    folder = tmp_path_factory.mktemp("unloadable")
    build("llama-tiny").config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors at all")
    return folder


@pytest.mark.parametrize("flags,said", [
    (["--data", "{tmp}/missing.txt"], "--data {tmp}/missing.txt: no such file"),
    (["--data", "{tmp}/corpus.csv"], "--data {tmp}/corpus.csv: use token ids (.npy, .pt or uint16 .bin) or text"),
    (["--data", "{tmp}/corpus.txt"], "--data {tmp}/corpus.txt is text and --model {model} has no tokenizer"),
    (["--data", "{tmp}/corpus.txt", "--tokenizer", "{tmp}/no-tokenizer"], "--tokenizer {tmp}/no-tokenizer: no such "
                                                                          "folder"),
    (["--resume", "{tmp}/no-run"], "--resume {tmp}/no-run: no such folder"),
])
def test_a_missing_input_is_one_line_naming_the_flag_before_the_model_loads(tmp_path, unloadable, flags, said):
    (tmp_path / "corpus.txt").write_text(TEXT)
    (tmp_path / "corpus.csv").write_text("text\nhello\n")
    fill = {"tmp": tmp_path, "model": unloadable}
    out = sltune("train", "--model", str(unloadable), *SMALL, "--steps", "2", *(f.format(**fill) for f in flags))
    err = one_error_line(out)
    assert said.format(**fill) in err, err
    assert "safetensors" not in err                    # the model was not loaded first


def test_a_missing_data_file_with_a_preset_is_refused_before_the_bar(tmp_path):
    out = sltune("train", "--model", "llama-tiny", *SMALL, "--steps", "2", "--data", str(tmp_path / "nope.npy"))
    err = one_error_line(out)
    assert f"--data {tmp_path / 'nope.npy'}: no such file" in err and "synthetic" in err


def test_a_resume_with_no_steps_left_is_refused_before_the_model_loads(tmp_path, unloadable):
    run = tmp_path / "run"
    assert sltune("train", "--model", "llama-tiny", *SMALL, "--steps", "2", "--save", str(run)).returncode == 0
    # one line and no progress bar: refused before the model is built
    err = one_error_line(sltune("train", "--model", "llama-tiny", *SMALL, "--steps", "2", "--resume", str(run)))
    assert f"--resume {run}: the checkpoint is at step 2" in err and "pass a larger --steps" in err


# -- 3. a device memory limit nothing fits ---------------------------------------------------------------------
def test_a_device_limit_below_the_smallest_config_is_refused_before_the_step_with_the_priors_minimum():
    from sltune.sizes import format_bytes
    from sltune.training.optimizer import OptimizerConfig
    from sltune.tuning.cost.prior import predict
    from sltune.tuning.cost.setup import Setup
    from sltune.tuning.cost.shape import shape_of
    from sltune.tuning.space import Candidate

    need = predict(Setup("llama-tiny", shape_of("llama-tiny"), seq_len=16, optimizer=OptimizerConfig()),
                   Candidate(1, 1, 1)).device
    out = sltune("train", "--model", "llama-tiny", "--seq-len", "16", "--sub-batch-size", "2", "--num-live-blocks",
                 "2", "--steps", "2", "--device-memory-limit", "1MiB")
    err = one_error_line(out)
    assert f"--device-memory-limit 1.0 MiB is below the {format_bytes(need)} ({need} bytes) the smallest config " \
           f"(b=1 N=1 k=1" in err, err
    # raise it, or (where the weights on disk would need less of the device) what would fit, then the limit
    assert "raise it to at least that" in err or \
        ("What would fit: " in err and "--device-memory-limit of at least" in err)
    assert "Lower sub_batch_size" not in err and "the step reached" not in err     # no step ran, no useless knobs


def test_a_config_over_a_limit_a_smaller_one_fits_names_the_knobs_to_lower(tmp_path):
    """b=2 N=2 k=2 needs some 1.9 MiB; under 1.5 MiB the prior says k=1 (1.2 MiB) fits: the line says so."""
    out = sltune("train", "--model", "llama-tiny", "--seq-len", "16", "--sub-batch-size", "2", "--num-sub-batches",
                 "2", "--num-live-blocks", "2", "--steps", "2", "--device-memory-limit", "1.5MiB")
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sltune train: error: device memory limit exceeded on cpu: the step reached"), last
    assert "pass --num-live-blocks 1" in last and "b=2 N=2 k=1 is predicted to need 1.2 MiB" in last, last
    assert "(the limit is --device-memory-limit)" in last
    fits = sltune("train", "--model", "llama-tiny", "--seq-len", "16", "--sub-batch-size", "2", "--num-sub-batches",
                  "2", "--num-live-blocks", "1", "--steps", "2", "--device-memory-limit", "1.5MiB", "--json")
    assert fits.returncode == 0, fits.stderr[-3000:]


def test_a_limit_the_prior_says_fits_trains_as_before():
    out = sltune("train", "--model", "llama-tiny", "--seq-len", "16", "--sub-batch-size", "2", "--num-sub-batches",
                 "2", "--num-live-blocks", "2", "--steps", "2", "--device-memory-limit", "3MiB", "--json")
    assert out.returncode == 0, out.stderr[-3000:]


# -- 4. torchrun and a world-size mismatch ---------------------------------------------------------------------
def test_a_world_size_mismatch_under_torchrun_is_said_once_by_rank_0_before_torchruns_failure():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "-m", "sltune.cli.main", "train", "--world-size", "1", "--steps", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0
    line = ("sltune train: error: --world-size is world_size 1 but 2 ranks are running; pass --world-size 2, or "
            "launch 1 with torchrun --nproc-per-node 1")
    assert out.stderr.count(line) == 1, out.stderr
    failure = out.stderr.find("ChildFailedError")
    assert failure != -1 and out.stderr.index(line) < failure, out.stderr
    assert "exitcode  : 2" in out.stderr                 # rank 0's own code is the root cause torchrun names
