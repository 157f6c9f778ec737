"""Peak host memory of tokenizing a text --data file (issue 31 M5): a file that is one long line, against the same
words in lines.

A byte-level BPE tokenizer is trained here on a sample of the words and saved with save_pretrained (nothing is
downloaded). The data is random words from a fixed list, with some punctuation, --mb megabytes on one line (and,
for comparison, the same text broken into lines of about 80 characters). Each round tokenizes each file in a fresh
process (sltune.training.text.tokenize_file, the cache written beside the file) and reports the process's peak
resident memory (resource.getrusage ru_maxrss) less its resident memory before tokenizing, and the time.

    python bench/text_memory.py                   # 50 MB, 1 round
    python bench/text_memory.py --mb 10 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    from sltune.training import text
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    import numpy, tokenizers, transformers
    text.load_tokenizer(sys.argv[2])
    before = rss()
    start = time.perf_counter()
    out = text.tokenize_file(sys.argv[1], sys.argv[2])
    took = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak, "before": before, "s": took, "tokens": int(out.ids.size),
                      "from_cache": out.from_cache}))
""")


def make_tokenizer(folder: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(words[i:i + 50]) for i in range(0, len(words), 50)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)
    return folder


def make_text(mb: int, seed: int = 0) -> tuple[str, list[str]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, rng.integers(1, 11))) for _ in range(5000)]
    vocab += [",", ".", "!", "(x)", "42", "3.14", "don't"]
    need = mb * 1_000_000
    picks = rng.integers(0, len(vocab), need // 4)
    out = " ".join(vocab[i] for i in picks)
    while len(out) < need:
        out += " " + out[: need - len(out)]
    return out[:need].rstrip(), vocab


def run(path: Path, tok: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(tok)], capture_output=True, text=True,
                       cwd=ROOT, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--lines", action="store_true", help="also the same text in lines of ~80 characters")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text, vocab = make_text(args.mb)
        tok = make_tokenizer(tmp / "tok", vocab)
        files = {"one line": tmp / "oneline.txt"}
        files["one line"].write_text(text, encoding="utf-8")
        if args.lines:
            files["lines"] = tmp / "lines.txt"
            words, lines, at = text.split(" "), [], 0
            while at < len(words):
                lines.append(" ".join(words[at:at + 14]))
                at += 14
            files["lines"].write_text("\n".join(lines), encoding="utf-8")
        del text
        results: dict[str, list[dict]] = {k: [] for k in files}
        for _ in range(args.rounds):
            for name, path in files.items():
                for cache in tmp.glob(f"{path.name}.sltune-*.npy"):
                    cache.unlink()
                results[name].append(run(path, tok))
        for name, rs in results.items():
            peaks = [(r["peak"] - r["before"]) / 2**20 for r in rs]
            print(f"{name:9s} {args.mb} MB: {rs[0]['tokens']} tokens; peak over baseline "
                  f"{statistics.median(peaks):.0f} MiB [{min(peaks):.0f}, {max(peaks):.0f}] (process peak "
                  f"{statistics.median(r['peak'] for r in rs) / 2**20:.0f} MiB), "
                  f"{statistics.median(r['s'] for r in rs):.1f} s")


if __name__ == "__main__":
    main()
