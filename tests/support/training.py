"""`sltune train` in this process with small knobs, and the metrics log it writes (--log)."""

import json

from sltune.cli.main import main

KNOBS = ["--seq-len", "16", "--sub-batch-size", "2", "--num-sub-batches", "2", "--num-live-blocks", "2"]


def train(*args) -> int:
    return main(["train", *KNOBS, *args])


def log(path):
    return [json.loads(line) for line in path.read_text().splitlines()]
