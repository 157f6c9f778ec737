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
With confirm_rounds 0 nothing is re-run and the statement is the unpaired one, saying so.

The rounds are a race: they measure only what is still undecided. After each whole round a finalist the
round's leader beats decisively (the low end of the paired interval above DECISIVE) drops out, and the rounds
end once only the search's best is left (it never drops out: a reversal is measured to the last round), or
once two rounds have measured the leader and every rival alike (the paired interval within EQUIVALENT either
way: more rounds would only narrow an interval that already says either is as good). Re-measuring a config
1.66x [1.60, 1.69] slower twice more only doubled the cost of a small search (bench/noise.py (e)). A gap one
round measured under interference (a trial marked unstable) must show in a second round before it counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any

from sltune.profiling.stats import paired_ratio_ci, ratio_ci
from sltune.profiling.timing import step_tokens_per_s, timing_of
from sltune.tuning.search.state import FinishedTrial, SearchState
from sltune.tuning.space import Candidate
from sltune.tuning.spec import MAX_FINALISTS

DECISIVE = 1.10     # the low end of the leader's paired interval over a rival that drops the rival
EQUIVALENT = 1.05   # a paired interval within [1/1.05, 1.05] after two rounds: measured alike, the rounds end


def ranked(state: SearchState) -> list[FinishedTrial]:
    """Each successfully measured config's best search trial, fastest first."""
    seen: dict[Candidate, FinishedTrial] = {}
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
    """The most confirmation trials the rounds may run, in order (none when only one config ran): every
    finalist in every round, as when none drops out."""
    picks = finalists(state)
    return picks * rounds if len(picks) > 1 else []


@dataclass
class Race:
    """The confirmation trials run so far, grouped into rounds; the finalists still in the race."""
    rounds: list[dict[Candidate, FinishedTrial]]     # round r: each finalist measured in it, and its trial
    racing: list[Candidate]                 # measured in the round under way, or the next
    partial: bool                           # the last round is under way

    @property
    def whole(self) -> int:
        return len(self.rounds) - self.partial


def race(state: SearchState, picks: list[Candidate]) -> Race:
    """Replays the rounds from the stored confirmation trials (each round measures the finalists still racing,
    in the order of `picks`), dropping the decisively beaten at the end of each: a resumed job sees the race
    as it stood."""
    trials = [d for d in state.confirms if d.candidate in picks]
    racing, rounds, at = list(picks), [], 0
    while at < len(trials) and len(racing) > 1:
        chunk = trials[at:at + len(racing)]
        at += len(chunk)
        rounds.append({d.candidate: d for d in chunk})
        if len(chunk) < len(racing):
            return Race(rounds, racing, partial=True)
        racing = _survivors(rounds, racing, picks[0])
    return Race(rounds, racing, partial=False)


def remaining(state: SearchState, picks: list[Candidate], rounds: int) -> list[Candidate]:
    """The confirmation trials still to run, in order, if no finalist drops out: the rest of the round under way,
    then every finalist still racing in each round left. Empty once the rounds are done or settled."""
    if len(picks) < 2:
        return []
    r = race(state, picks)
    if r.partial:
        return [c for c in r.racing if c not in r.rounds[-1]] + r.racing * max(0, rounds - len(r.rounds))
    if settled(state, picks, r):
        return []
    return r.racing * max(0, rounds - r.whole)


def settled(state: SearchState, picks: list[Candidate], r: Race | None = None) -> bool:
    """Whether the rounds so far decide it: every rival of the search's best dropped out (beaten decisively,
    cleanly or in two rounds), or two whole rounds measured the leader and every rival alike."""
    r = r or race(state, picks)
    if len(picks) < 2 or r.partial or not r.rounds:
        return False
    if r.racing == picks[:1]:
        return True
    if r.whole < 2:
        return False
    series = _series(r.rounds, r.racing)
    leader = _leader(series, r.racing, picks[0])
    for c in r.racing:
        if c != leader:
            a, b = _paired(series[leader], series[c])
            if not a:
                return False
            lo, hi = paired_ratio_ci(a, b)[1]
            if lo < 1 / EQUIVALENT or hi > EQUIVALENT:
                return False
    return True


def verdict(state: SearchState, picks: list[Candidate]) -> dict[str, Any] | None:
    """The winner, the runner-up and the ratio between them: paired, from the confirm trials run so far; or,
    when the best had no rival to re-measure, unpaired from the search's trials. The winner is a finalist still
    racing; the runner-up the next by its paired ratio to the search's best."""
    order = ranked(state)
    if len(order) < 2:
        return None
    if len(picks) < 2:
        best, runner = order[0], order[1]
        ratio, (lo, hi) = ratio_ci([step_tokens_per_s(best.result)], [step_tokens_per_s(runner.result)])
        how = "; not re-measured (search.confirm_rounds is 0)"
        return _answer(best.candidate, runner.candidate, ratio, lo, hi, rounds=0, finalists=[], changed=False,
                       how=how)
    r = race(state, picks)
    series = _series(r.rounds, picks)
    ref = picks[0]
    ratios: dict[Candidate, float] = {}
    for c in picks:
        a, b = _paired(series[c], series[ref])
        if a:
            ratios[c] = paired_ratio_ci(a, b)[0] if c != ref else 1.0
    contenders = [c for c in r.racing if c in ratios]
    if ref not in ratios or len(ratios) < 2 or not contenders:
        return None
    winner = max(contenders, key=lambda c: ratios[c])
    runner = max((c for c in ratios if c != winner), key=lambda c: ratios[c])
    a, b = _paired(series[winner], series[runner])
    ratio, (lo, hi) = paired_ratio_ci(a, b)
    measured = [{"config": c.knobs(), "ratio_to_search_best": ratios.get(c),
                 "round_medians": [median(s) for s in series[c] if s],
                 "dropped_after_round": None if c in r.racing else _dropped_after(r.rounds, c)} for c in picks]
    return _answer(winner, runner, ratio, lo, hi, rounds=len(a), finalists=measured, changed=winner != ref,
                   how="")


def _series(rounds: list[dict[Candidate, FinishedTrial]],
            picks: list[Candidate]) -> dict[Candidate, list[list[float] | None]]:
    """Each finalist's step tokens/s per round (None: not measured in that round, or its trial failed)."""
    return {c: [step_tokens_per_s(r[c].result) if c in r else None for r in rounds] for c in picks}


def _paired(a: list[list[float] | None], b: list[list[float] | None]) -> tuple[list[list[float]], list[list[float]]]:
    """The rounds both measured."""
    both = [(x, y) for x, y in zip(a, b) if x and y]
    return [x for x, _ in both], [y for _, y in both]


def _leader(series: dict[Candidate, list[list[float] | None]], racing: list[Candidate], ref: Candidate) -> Candidate:
    """The finalist with the highest paired ratio to the search's best (which is always racing)."""
    def ratio(c: Candidate) -> float:
        if c == ref:
            return 1.0
        a, b = _paired(series[c], series[ref])
        return paired_ratio_ci(a, b)[0] if a else 0.0
    return max(racing, key=ratio)


def _survivors(rounds: list[dict[Candidate, FinishedTrial]], racing: list[Candidate],
               ref: Candidate) -> list[Candidate]:
    """After a whole round: the finalists the leader did not beat decisively. The search's best always stays.
    One round decides only where neither trial ran under interference; two rounds decide either way."""
    series = _series(rounds, racing)
    leader = _leader(series, racing, ref)

    def beaten(c: Candidate) -> bool:
        a, b = _paired(series[leader], series[c])
        if not a:
            return False
        clean = not any(timing_of(r[x].result).get("unstable") for r in rounds for x in (leader, c) if x in r)
        return (len(a) >= 2 or clean) and paired_ratio_ci(a, b)[1][0] > DECISIVE

    return [c for c in racing if c in (ref, leader) or not beaten(c)]


def _dropped_after(rounds: list[dict[Candidate, FinishedTrial]], c: Candidate) -> int:
    return sum(c in r for r in rounds)


def _answer(winner: Candidate, runner: Candidate, ratio: float, lo: float, hi: float, *, rounds: int,
            finalists: list[dict[str, Any]], changed: bool, how: str) -> dict[str, Any]:
    significant = lo > 1.0
    statement = (f"{winner}: {ratio:.2f}x [{lo:.2f}, {hi:.2f}] the runner-up ({runner})"
                 + ("" if significant else "; within noise: either is as good") + how)
    return {"winner": winner.knobs(), "runner_up": runner.knobs(), "ratio": ratio, "ci95": [lo, hi],
            "significant": significant, "rounds": rounds, "finalists": finalists, "changed_pick": changed,
            "statement": statement}


def winner_of(state: SearchState, confirmation: dict[str, Any] | None) -> FinishedTrial | None:
    """The search trial of the confirmed winner, or the search's best when nothing was confirmed."""
    best = state.best()
    if not confirmation:
        return best
    w = confirmation["winner"]
    ok = [d for d in state.history if d.ok and d.candidate.knobs() == w and not state.reduced(d)]
    return max(ok, key=lambda d: d.tokens_per_s) if ok else best


def time_left(state: SearchState, search: Any, elapsed: float, rest: list[Candidate] | None,
              seconds: dict[tuple[Candidate, bool], list[float]], avg: float | None,
              trials_cap: int | None = None, at_once: int = 1) -> float:
    """Seconds the job has left. The confirmation trials still to run (`rest` once the search has ended, else
    every finalist as they stand, in each of `confirm_rounds`, as many as `trials_cap` leaves after the search's
    max_trials: the trials in all a server allows) are counted at their own config's median
    confirmation trial time so far, else its search trials' (the finalists are the largest configs, and an
    average over the search's small probes said 6-8 s where 25 s ran). The search's remaining trials count at
    the average, `at_once` at a time (hardware.parallel_trials: at most; oneshot runs only its probes so); the time
    budget caps both, except for a trial already started or about to start."""
    budget = search.time_budget_s - elapsed

    def cost(c: Candidate) -> float:
        took = measured_seconds(seconds, c)
        return (avg or 0.0) if took is None else took

    if rest is not None:
        return min(sum(map(cost, rest)), max(budget, 0.0) + cost(rest[0])) if rest else 0.0
    if avg is None:
        return budget
    coming = plan(state, search.confirm_rounds)
    if trials_cap is not None:
        coming = coming[:max(0, trials_cap - search.max_trials)]
    return min(budget, (search.max_trials - len(state.history)) * avg / at_once + sum(map(cost, coming)))


def measured_seconds(seconds: dict[tuple[Candidate, bool], list[float]], c: Candidate) -> float | None:
    """What a trial of c takes, from its own full-depth trials so far (`seconds`, by config and whether they were
    confirmation trials): the median of its confirmation trials, else of its search trials; None before any."""
    times = seconds.get((c, True)) or seconds.get((c, False))
    return median(times) if times else None


def _ci(d: FinishedTrial) -> tuple[float, float]:
    ci = timing_of(d.result).get("tokens_per_s_ci95")
    return tuple(ci) if ci else (d.tokens_per_s, d.tokens_per_s)
