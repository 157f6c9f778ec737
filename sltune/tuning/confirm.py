"""The confirmation round: before a job ends, its best and every config that might be as good are measured
again, side by side, and the winner is picked by paired ratios.

A search measures each config once, at a different moment: whatever else ran on the machine then is in
that number. The finalists (the best, every config whose interval overlaps the best's, and in any case the
runner-up) are re-measured in rounds, A B C A B C ..., so each round sees them under the same conditions.
Per round, each finalist's median is divided by the search best's; the finalist with the highest median
ratio over the rounds wins. Its ratio to the runner-up, with a paired bootstrap interval
(sltune.profiling.stats), is how sure the pick is. The runner-up is re-measured even when the intervals do
not overlap: an unpaired interval from two trials run at different moments proved overconfident (in
bench/noise.py (e) it claimed 1.16x [1.03, 1.30] where side by side the other config was 4.6% faster).
With confirm_rounds 0 nothing is re-run and the statement is the unpaired one, saying so. The rounds stop
early once the search's best has won decisively (settled()): re-measuring a config 1.66x [1.60, 1.69] slower
twice more only doubled the cost of a small search (bench/noise.py (e)).
"""

from __future__ import annotations

from statistics import median
from typing import Any

from sltune.profiling.stats import paired_ratio_ci, ratio_ci
from sltune.profiling.timing import step_tokens_per_s, timing_of
from sltune.tuning.space import Candidate
from sltune.tuning.state import Done, SearchState

MAX_FINALISTS = 3
DECISIVE = 1.10     # the low end of the winner's paired interval over the runner-up that ends the rounds early


def ranked(state: SearchState) -> list[Done]:
    """Each successfully measured config's best search trial, fastest first."""
    seen: dict[Candidate, Done] = {}
    for d in sorted((d for d in state.history if d.ok and not state.reduced(d)), key=lambda d: d.tokens_per_s,
                    reverse=True):
        seen.setdefault(d.candidate, d)
    return list(seen.values())


def finalists(state: SearchState) -> list[Candidate]:
    """The search's best first, then every config whose interval overlaps it, or else the runner-up (at most
    MAX_FINALISTS)."""
    order = ranked(state)
    if not order:
        return []
    best_lo = _ci(order[0])[0]
    rivals = [d.candidate for d in order[1:] if _ci(d)[1] >= best_lo] or [d.candidate for d in order[1:2]]
    return [order[0].candidate] + rivals[:MAX_FINALISTS - 1]


def plan(state: SearchState, rounds: int) -> list[Candidate]:
    """The interleaved order the confirmation trials run in (none when only one config ran)."""
    picks = finalists(state)
    return picks * rounds if len(picks) > 1 else []


def verdict(state: SearchState, picks: list[Candidate]) -> dict[str, Any] | None:
    """The winner, the runner-up and the ratio between them: paired, from the confirm trials run so far; or,
    when the best had no rival to re-measure, unpaired from the search's trials."""
    order = ranked(state)
    if len(order) < 2:
        return None
    if len(picks) < 2:
        best, runner = order[0], order[1]
        ratio, (lo, hi) = ratio_ci([step_tokens_per_s(best.result)], [step_tokens_per_s(runner.result)])
        how = "; not re-measured (search.confirm_rounds is 0)"
        return _answer(best.candidate, runner.candidate, ratio, lo, hi, rounds=0, finalists=[], changed=False,
                       how=how)
    samples: dict[Candidate, list[list[float] | None]] = {c: [] for c in picks}
    for d in state.confirms:                  # in the order run: round r is the r-th of each finalist
        if d.candidate in samples:
            samples[d.candidate].append(step_tokens_per_s(d.result))
    rounds = min(len(v) for v in samples.values())
    paired = [r for r in range(rounds) if all(samples[c][r] for c in picks)]   # rounds every finalist finished
    if not paired:
        return None
    series = {c: [samples[c][r] for r in paired] for c in picks}
    ref = picks[0]
    ratios = {c: paired_ratio_ci(series[c], series[ref])[0] if c != ref else 1.0 for c in picks}
    order_c = sorted(picks, key=lambda c: ratios[c], reverse=True)
    winner, runner = order_c[0], order_c[1]
    ratio, (lo, hi) = paired_ratio_ci(series[winner], series[runner])
    measured = [{"config": c.knobs(), "ratio_to_search_best": ratios[c],
                 "round_medians": [median(s) for s in series[c]]} for c in picks]
    return _answer(winner, runner, ratio, lo, hi, rounds=len(paired), finalists=measured, changed=winner != ref,
                   how="")


def settled(state: SearchState, picks: list[Candidate]) -> bool:
    """Whether the rounds so far already decide it: the search's best won every paired comparison, its
    interval over the runner-up starts above DECISIVE, and no confirm trial of theirs ran under interference
    (marked unstable), which could have made the gap."""
    if len(picks) < 2 or len(state.confirms) % len(picks):
        return False                         # only after whole rounds
    if any(timing_of(d.result).get("unstable") for d in state.confirms if d.candidate in picks):
        return False
    answer = verdict(state, picks)
    return bool(answer and not answer["changed_pick"] and answer["ci95"][0] > DECISIVE)


def _answer(winner: Candidate, runner: Candidate, ratio: float, lo: float, hi: float, *, rounds: int,
            finalists: list[dict[str, Any]], changed: bool, how: str) -> dict[str, Any]:
    significant = lo > 1.0
    statement = (f"{winner}: {ratio:.2f}x [{lo:.2f}, {hi:.2f}] the runner-up ({runner})"
                 + ("" if significant else "; within noise: either is as good") + how)
    return {"winner": winner.knobs(), "runner_up": runner.knobs(), "ratio": ratio, "ci95": [lo, hi],
            "significant": significant, "rounds": rounds, "finalists": finalists, "changed_pick": changed,
            "statement": statement}


def winner_of(state: SearchState, confirmation: dict[str, Any] | None) -> Done | None:
    """The search trial of the confirmed winner, or the search's best when nothing was confirmed."""
    best = state.best()
    if not confirmation:
        return best
    w = confirmation["winner"]
    ok = [d for d in state.history if d.ok and d.candidate.knobs() == w and not state.reduced(d)]
    return max(ok, key=lambda d: d.tokens_per_s) if ok else best


def time_left(state: SearchState, search: Any, elapsed: float, queue: list[Candidate] | None,
              seconds: dict[Candidate, list[float]], avg: float | None) -> float:
    """Seconds the job has left. The confirmation trials still to run (all of `queue` once the search has
    ended, else the finalists as they stand, each `confirm_rounds` times) are counted at their own config's
    median trial time so far: the finalists are the largest configs, and an average over the search's small
    probes said 6-8 s where 25 s ran. The search's remaining trials count at the average; the time budget
    caps both, except for a trial already started or about to start."""
    budget = search.time_budget_s - elapsed

    def cost(c: Candidate) -> float:
        return median(seconds[c]) if seconds.get(c) else (avg or 0.0)

    if queue is not None:
        rest = queue[len(state.confirms):]
        return min(sum(map(cost, rest)), max(budget, 0.0) + cost(rest[0])) if rest else 0.0
    if avg is None:
        return budget
    coming = plan(state, search.confirm_rounds)
    return min(budget, (search.max_trials - len(state.history)) * avg + sum(map(cost, coming)))


def _ci(d: Done) -> tuple[float, float]:
    ci = timing_of(d.result).get("tokens_per_s_ci95")
    return tuple(ci) if ci else (d.tokens_per_s, d.tokens_per_s)

