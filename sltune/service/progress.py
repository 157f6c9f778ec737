"""How many trials a job has run, said one way everywhere (the CLI's bar, the job list, the job page): search
and confirmation trials apart, since max_trials bounds the search only. "10 trials" beside a table of 16
read as a bug."""

from __future__ import annotations

from typing import Any


def trial_counts(progress: dict[str, Any], finished: bool) -> str:
    """"3/12 search" while searching, "10 search + 2/6 confirm" during the confirmation round, "10 search +
    6 confirm" once finished (a job that stopped early ran all it will run)."""
    search = int(progress.get("trials_done") or 0)
    confirm = int(progress.get("confirm_done") or 0)
    if finished:
        return f"{search} search + {confirm} confirm"
    planned = progress.get("confirm_planned")
    if planned or confirm:
        return f"{search} search + {confirm}/{int(planned or confirm)} confirm"
    total = progress.get("max_trials")
    return f"{search}/{int(total)} search" if total else f"{search} search"


def trials_run(progress: dict[str, Any]) -> int:
    """Every finished trial, search and confirm."""
    return int(progress.get("trials_done") or 0) + int(progress.get("confirm_done") or 0)
