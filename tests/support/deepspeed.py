"""DeepSpeed is an optional extra: a test that needs it skips without it, saying how to install it."""

import importlib.util

import pytest

from sltune.backends.deepspeed_ops import INSTALL

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason=f"DeepSpeed is not installed (`{INSTALL}`; the README's test command "
                                            "installs it)")
