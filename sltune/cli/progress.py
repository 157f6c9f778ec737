"""One progress bar for a tuning job, run here (`tune`) or on a server (`submit --wait`): its label
follows the job's state, and a finished job's bar is full and shows no time left."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from sltune.service.progress import trial_counts, trials_run

FINISHED = ("succeeded", "failed", "cancelled")


class JobBar:
    def __init__(self, label: str, total: int, disable: bool = False):
        self.label = label
        self.bar = tqdm(total=total, unit="trial", desc=label, disable=disable)
        self.note: str | None = None


    def show(self, progress: dict[str, Any], status: str | None = None, waiting_for: str | None = None) -> None:
        done = trials_run(progress)        # search and confirm trials alike; the postfix tells them apart
        if progress.get("note") and progress["note"] != self.note:     # what the job does between trials
            self.note = progress["note"]
            self.bar.write(f"  {self.note}")
        finished = status in FINISHED or progress.get("phase") == "finished"
        if finished:
            self.bar.total = done          # a job may stop before max_trials: what it ran is all it will run
        elif progress.get("confirm_planned"):
            self.bar.total = int(progress.get("trials_done") or 0) + progress["confirm_planned"]
        self.bar.n = done
        if status is not None:
            state = f"queued, waiting for {waiting_for}" if status == "queued" and waiting_for else status
            self.bar.set_description(f"{self.label} {state}", refresh=False)
        best = progress.get("best_tokens_per_s")
        postfix = {"trials": trial_counts(progress, finished), "best": f"{best:,.1f} tok/s" if best else "-"}
        if not finished:
            postfix["left"] = f"{progress.get('time_left_s') or 0:.0f}s"
            if progress.get("phase"):
                postfix["phase"] = progress["phase"]
        self.bar.set_postfix(postfix)

    def close(self) -> None:
        self.bar.close()


def describe_config(config: dict[str, Any]) -> str:
    """b=8 N=4 k=1 (speedloader): the knobs as people read them, as the tuner names its candidates."""
    from sltune.tuning.space import Candidate     # here, not at import: `submit` need not load Optuna to start

    return str(Candidate.from_knobs(config)) + (f" ({config['schedule']})" if config.get("schedule") else "")
