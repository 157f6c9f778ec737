"""The tuning spec POST /tune shows as its example in /docs and /redoc: `examples/tiny-llama-cpu.yaml`, the spec the
README's first command tunes and the docs include, so "Try it out" sends a spec the server accepts (the schema alone
made up `preset: "string"` and `sub_batch_size: 0`).

In a checkout (an editable install, the tests) it is read from `examples/`. An installed wheel (the Docker image)
has no `examples/` folder: there it is read from the package data `tiny-llama-cpu.yaml` beside this module, a copy
tests/unit/api/test_examples.py holds byte for byte equal to the one in `examples/`."""

from __future__ import annotations

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parents[1] / "examples" / "tiny-llama-cpu.yaml"
PACKAGED = HERE / "tiny-llama-cpu.yaml"

TUNE_EXAMPLE = yaml.safe_load((SOURCE if SOURCE.is_file() else PACKAGED).read_text())
