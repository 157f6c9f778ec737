"""The confirmation round (sltune.tuning.search.confirm): which configs are measured again beside the best, and when
its rounds end."""

from sltune.tuning.search.state import FinishedTrial
from sltune.tuning.space import Candidate
from tests.support.search import state


def ok(number: int, c: Candidate, tokens_per_s: float, ci: tuple[float, float]) -> FinishedTrial:
    return FinishedTrial(number, c, "grid", {"status": "ok", "tokens_per_s": tokens_per_s, "step_seconds": 1.0,
                                    "peak_device_bytes": 1, "peak_host_bytes": 1,
                                    "timing": {"steps_s": [1.0] * 5, "tokens_per_s_ci95": list(ci)}})


def test_the_runner_up_is_a_finalist_even_when_no_interval_overlaps_the_best():
    """Two trials run at different moments cannot be compared by their own intervals: the runner-up is
    re-measured beside the best whatever the intervals say; overlapping rivals join it."""
    from sltune.tuning.search import confirm

    st = state()
    a, b, c = Candidate(4, 4, 1), Candidate(2, 4, 1), Candidate(1, 4, 1)
    for i, (cand, tps, ci) in enumerate([(a, 1000.0, (990, 1010)), (b, 800.0, (790, 810)), (c, 500.0, (490, 510))]):
        st.add(ok(i, cand, tps, ci))
    assert confirm.finalists(st) == [a, b]
    assert confirm.plan(st, 2) == [a, b, a, b]
    st.add(ok(3, Candidate(4, 2, 1), 700.0, (600, 995)))        # overlaps the best: it is the rival now
    assert confirm.finalists(st) == [a, Candidate(4, 2, 1)]


def test_confirmation_rounds_end_early_only_when_the_search_best_won_decisively_and_cleanly():
    from sltune.tuning.search import confirm

    st = state()
    a, b = Candidate(4, 4, 1), Candidate(2, 4, 1)
    st.add(ok(0, a, 1000.0, (990, 1010)))
    st.add(ok(1, b, 700.0, (690, 710)))
    picks = confirm.finalists(st)
    assert picks == [a, b] and not confirm.settled(st, picks)

    def round_(tps_a: float, tps_b: float, unstable: bool = False) -> None:
        for cand, tps in ((a, tps_a), (b, tps_b)):
            d = ok(len(st.confirms) + 2, cand, tps, (tps * 0.99, tps * 1.01))
            d.result["timing"].update(steps_s=[cand.batch * 32 / tps * (1 + 0.01 * i) for i in range(5)],
                                      tokens_per_step=cand.batch * 32)
            d.result["timing"]["unstable"] = unstable
            st.confirms.append(d)
            if cand == a:
                assert not confirm.settled(st, picks)           # never in the middle of a round

    round_(1000.0, 950.0)
    assert not confirm.settled(st, picks)                       # 1.05x: not decisive
    st.confirms.clear()
    round_(1000.0, 600.0, unstable=True)
    assert not confirm.settled(st, picks)                       # decisive, but measured under interference
    st.confirms.clear()
    round_(1000.0, 600.0)
    assert confirm.settled(st, picks)                           # 1.67x, clean: settled after one round
    st.confirms.clear()
    round_(600.0, 1000.0)
    assert not confirm.settled(st, picks)                       # the runner-up won: keep measuring


def test_a_gap_measured_under_interference_must_show_in_two_rounds():
    """One round that measured a rival 1.67x slower drops it only if neither trial ran under interference;
    a second round with the same gap drops it either way."""
    from sltune.tuning.search import confirm

    st = state()
    a, b = Candidate(4, 4, 1), Candidate(2, 4, 1)
    st.add(ok(0, a, 1000.0, (990, 1010)))
    st.add(ok(1, b, 700.0, (690, 710)))
    picks = confirm.finalists(st)

    def round_(tps_a: float, tps_b: float, unstable: bool) -> None:
        for cand, tps in ((a, tps_a), (b, tps_b)):
            d = ok(len(st.confirms) + 2, cand, tps, (tps * 0.99, tps * 1.01))
            d.result["timing"].update(steps_s=[cand.batch * 32 / tps * (1 + 0.01 * i) for i in range(5)],
                                      tokens_per_step=cand.batch * 32, unstable=unstable)
            st.confirms.append(d)

    round_(1000.0, 600.0, unstable=True)
    assert confirm.remaining(st, picks, 3) == [a, b, a, b]
    round_(1000.0, 600.0, unstable=True)
    assert confirm.settled(st, picks) and confirm.remaining(st, picks, 3) == []
    assert confirm.verdict(st, picks)["rounds"] == 2


def test_time_left_counts_the_search_s_trials_to_come_at_the_trials_run_at_once():
    """hardware.parallel_trials: the search's remaining trials take their average time each, `at_once` at a time;
    the confirmation trials to come, one at a time, at their own configs' times."""
    from types import SimpleNamespace

    from sltune.tuning.search import confirm

    st = state()
    a, b = Candidate(4, 4, 1), Candidate(2, 4, 1)
    st.add(ok(0, a, 1000.0, (990, 1010)))
    st.add(ok(1, b, 990.0, (980, 1000)))
    search = SimpleNamespace(time_budget_s=10_000.0, max_trials=10, confirm_rounds=1)
    seconds = {(a, False): [30.0], (b, False): [20.0]}
    one = confirm.time_left(st, search, 0.0, None, seconds, 10.0)
    two = confirm.time_left(st, search, 0.0, None, seconds, 10.0, at_once=2)
    assert (one, two) == (8 * 10.0 + 30.0 + 20.0, 8 * 10.0 / 2 + 30.0 + 20.0)
