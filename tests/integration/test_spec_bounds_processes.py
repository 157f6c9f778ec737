"""Issue #31 M4 and 12: SpecChecker's process pool answers a valid spec while a slow one is checked, and a
capped job (the runner on a SQLite store) reports only the confirmation the cap leaves."""

import asyncio
import json
import time

from tests.support.specs import tiny_spec


def test_a_slow_check_does_not_hold_a_valid_post_behind_it(tmp_path):
    """Two checker processes (the default where a machine has 3 cores or more; SLTUNE_SPEC_CHECK_WORKERS): a spec
    whose check takes seconds (a 400-layer model built on the meta device) leaves the other free, so a valid spec
    posted meanwhile is answered at once, not after it."""
    from sltune.service.validation import SpecChecker
    from sltune.settings import Settings

    slow = {"name": "slow", "model": {"hf_config": {"model_type": "gpt2", "n_layer": 400, "n_embd": 256,
                                                    "n_head": 4}}}
    checker = SpecChecker(Settings(data_dir=tmp_path, spec_check_workers=2))

    async def both() -> dict:
        await checker.warm_up()
        done = {}

        async def timed(name: str, body: dict) -> None:
            start = time.perf_counter()
            verdict = await checker.check(json.dumps(body).encode())
            done[name] = (time.perf_counter() - start, verdict)

        heavy = asyncio.ensure_future(timed("slow", slow))
        await asyncio.sleep(0.3)
        await timed("valid", tiny_spec("valid"))
        await heavy
        return done

    try:
        done = asyncio.run(both())
    finally:
        checker.close()
    assert done["valid"][1].job is not None, done["valid"][1].errors
    # one checker: the valid spec waited for the slow one (8.5 s of a 9.5 s check sent 1 s before it)
    assert done["valid"][0] < done["slow"][0] / 2, {k: round(v[0], 2) for k, v in done.items()}


# -- 12: the confirmation a capped job reports is the one it runs ----------------------------------------------
def test_a_capped_job_reports_only_the_confirmation_the_cap_leaves(tmp_path, monkeypatch):
    """3 search trials and 20 rounds of 3 finalists asked for, 4 trials in all allowed: one confirmation
    trial runs, and that is what the job's progress plans (it said 60)."""
    import sltune.executors.local as local
    from sltune.service.local import tune
    from sltune.settings import Settings
    from tests.support.fake_trials import FakeTrials

    monkeypatch.setattr(local, "run_trial", FakeTrials({1: 1990.0, 2: 2000.0, 4: 1995.0}))
    spec = tiny_spec("capped", trials=3, strategy="grid", num_sub_batches=[1], num_live_blocks=[1],
                     confirm_rounds=20)
    calls = []
    r = tune(spec, f"sqlite:///{tmp_path / 'jobs.db'}", progress=calls.append,
             settings=Settings(data_dir=tmp_path, max_trials=4))
    assert r["status"] == "succeeded", r
    assert [t["role"] for t in r["trials"]].count("confirm") == 1
    planned = [(c["phase"], c["confirm_planned"]) for c in calls if c["confirm_planned"] is not None]
    assert planned and all(p == 1 for _, p in planned), planned
    assert planned[-1] == ("finished", 1) and calls[-1]["confirm_done"] == 1
