"""The "Train your own model" guide's block (docs/guides/training.md; the README points to it), run as it is
written: a model folder in, tuned, trained in bf16 on a text file, and a folder out that transformers loads."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]


def guide_block(page: str) -> str:
    """The first bash block of a docs page: what a user copies from it."""
    return re.search(r"```bash\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S).group(1)


def test_the_train_your_own_model_block_runs_and_transformers_loads_the_result(tmp_path):
    shutil.copy(ROOT / "README.md", tmp_path)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SLTUNE_DATA_DIR": str(tmp_path / "sltune-data")}
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", guide_block("guides/training.md")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "torch.bfloat16" in out.stdout.splitlines()[-1]               # the python -c line's print
    assert "held-out loss" in out.stdout
    assert next(tmp_path.glob("corpus.txt.sltune-*.npy"))                  # the tokenized text, cached
    best = (tmp_path / "best.yaml").read_text()
    assert "mixed_precision: true" in best and "optimizer:" in best and "my-model" in best
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "my-model")
    assert (tmp_path / "trained" / "tokenizer.json").is_file()
    assert trained.dtype == torch.bfloat16
    assert not torch.equal(trained.lm_head.weight, source.lm_head.weight)    # it trained
