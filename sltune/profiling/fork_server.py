"""What multiprocessing's fork server imports first (its preload): it dies with the process that started
it, then preloads torch and transformers so that each trial or spec check it forks starts in well under
a second. That process may die while the fork server is still importing (seconds on a busy machine), so
it is named by pid (set by fork_server_dies_with_me) rather than taken from getppid() now."""

import os

from sltune.profiling.lifeline import PARENT_ENV, die_with_parent

die_with_parent(parent=int(os.environ.get(PARENT_ENV, "0")) or None)

import sltune.profiling.preload  # noqa: E402,F401
