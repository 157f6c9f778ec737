"""The confirmation round as the runner plays it on a SQLite store, with trials whose figures the test sets."""


def test_the_confirmation_is_a_race_the_decisively_beaten_drop_out_and_alike_rivals_end_it(tmp_path, monkeypatch):
    """Issue #30: three finalists in three rounds cost 9 trials whatever they measured. Now a finalist the
    leader beats decisively after a clean round drops out, and the rounds end once two of them measured the
    rest alike: here b=1 (2x slower when re-measured) runs one confirmation trial, b=2 and b=4 (0.25% apart)
    two each, and the bar's total follows. Confirmation trials are neither profiled nor re-timed within a trial:
    the paired rounds are their repetition."""
    import sltune.executors.local as local
    from sltune.settings import Settings
    from sltune.service.local import tune
    from tests.support.specs import tiny_spec
    from tests.support.fake_trials import FakeTrials

    fake = FakeTrials({1: 1990.0, 2: 2000.0, 4: 1995.0}, later={1: (0.5,)})
    monkeypatch.setattr(local, "run_trial", fake)
    spec = tiny_spec("race", trials=3, strategy="grid", num_sub_batches=[1], num_live_blocks=[1], confirm_rounds=3,
                     profile=True)
    calls = []
    r = tune(spec, f"sqlite:///{tmp_path / 'jobs.db'}", progress=calls.append, settings=Settings(data_dir=tmp_path))
    assert r["status"] == "succeeded", r
    confirms = [t["config"]["sub_batch_size"] for t in r["trials"] if t["role"] == "confirm"]
    assert confirms == [2, 4, 1, 2, 4], confirms                 # round 1: all three; round 2: b=1 has dropped out
    c = r["confirmation"]
    assert c["rounds"] == 2 and not c["significant"] and c["winner"]["sub_batch_size"] in (2, 4)
    dropped = {f["config"]["sub_batch_size"]: f["dropped_after_round"] for f in c["finalists"]}
    assert dropped == {2: None, 4: None, 1: 1}
    assert [s.profile for s in fake.specs] == [True] * 3 + [False] * 5
    assert [s.remeasure for s in fake.specs[3:]] == [0] * 5 and all(s.remeasure == 1 for s in fake.specs[:3])
    planned = [p["confirm_planned"] for p in calls if p["phase"] == "confirm"]
    assert planned[0] == 9 and planned[-1] == 5 and calls[-1]["confirm_planned"] == 5, planned
