"""Chaos under ``parcae run``: seeded random configurations and fault schedules must lose nothing and hang nowhere.

Every trial (``tests/chaos_harness.py``) runs the deterministic ``tests/elastic_job.py`` under ``parcae run`` with
faults injected from outside, and checks exit 0, the uninterrupted run's parameters (1e-5 relative), every sample
exactly once, replicas agreeing, and no stall beyond detection + a small bound. A failing trial prints the one
command that replays it.

The default suite runs the repros of issue 9 that need the real runtime under the launcher, plus a few drawn trials;
``pytest -m chaos`` runs 100 seeded trials (32 s each on average on 2 otherwise idle cores, 53 minutes in all on
2026-12-01; about 45 s each when the machine is shared).
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest

from chaos_harness import Trial, draw, run_trial

pytestmark = pytest.mark.multiprocess


def _check(result: dict) -> None:
    assert not result["failures"], "\n".join(result["failures"]) + f"\nreplay: {result['replay']}"


@pytest.mark.timeout(480)
def test_parcae_run_survives_a_kill_from_outside_with_the_undisturbed_parameters(tmp_path: Path) -> None:
    """Regression (issue 9, repro 2), with the real runtime: ``kill -9`` of a member from outside used to make
    ``parcae run`` stop every worker. Now the survivors recover in place, the launcher starts a fresh standby for
    the lost instance (admitted at a later interval), and the job ends with the undisturbed run's parameters."""
    trial = Trial(seed=-2, instances=3, batch=24, samples=96, pipeline_stages=1, micro_batches=2, schedule="1f1b",
                  optimizer="adam", val_every=0, after_fit=False, max_steps=26,
                  faults=[{"kind": "kill", "step": 6, "pick": 0.0}])
    result = run_trial(trial, tmp_path)
    _check(result)
    assert result["faults"][0]["victims"], result["faults"]
    assert result["recoveries_s"] and result["restarts"] == 0, (
        f"expected a recovery in place and no restart, got recoveries {result['recoveries_s']} and "
        f"{result['restarts']} restarts:\n" + Path(result["run_dir"], "parcae_run.log").read_text()[-3000:])


@pytest.mark.timeout(480)
def test_parcae_run_code_after_fit_works_if_a_hung_worker_came_back_as_a_standby(tmp_path: Path) -> None:
    """Regression (issue 9, repro 3), with the launcher: one worker SIGSTOPped 8 s then continued; it is fenced,
    returns as a standby and is admitted again, and at the end ``save_checkpoint``, ``validate``, ``test`` and
    ``predict`` after ``fit`` run on every member (a joiner's barrier used to return at once, so it exited while
    the others still waited: "Connection closed by peer")."""
    trial = Trial(seed=-3, instances=3, batch=24, samples=96, pipeline_stages=1, micro_batches=2, schedule="1f1b",
                  optimizer="sgd", val_every=7, after_fit=True, max_steps=30,
                  faults=[{"kind": "stop", "step": 5, "pick": 0.0}])
    result = run_trial(trial, tmp_path)
    _check(result)
    after = list(Path(result["run_dir"], "job").glob("after_*.json"))
    assert len(after) >= 2, after  # every member of the last generation ran the code after fit


@pytest.mark.timeout(480)
def test_parcae_run_on_8_instances_trains_a_batch_that_8_pipelines_cannot_split(tmp_path: Path) -> None:
    """Regression (chaos seed 700 run at 8 instances, the first trial beyond the drawn 2-6): the launcher seats a
    first generation of D a power of two before any worker knows the batch -- D = 8 here -- and a global batch of
    60 stopped every worker in Lightning's ``setup_data`` ("global batch size 60 cannot be split evenly over D=8
    pipelines"), so ``parcae run`` exited 1 on a batch that 6 pipelines split. Now the members move in place to
    D = 6 before the first step (two released as standbys) and the job ends with the undisturbed parameters."""
    import json  # noqa: PLC0415

    trial = Trial(seed=-8, instances=8, batch=60, samples=180, pipeline_stages=1, micro_batches=1, schedule="1f1b",
                  optimizer="adam", val_every=0, after_fit=False, max_steps=22, faults=[], scaled=True)
    result = run_trial(trial, tmp_path)
    _check(result)
    events = [json.loads(line) for line in Path(result["run_dir"], "events.jsonl").read_text().splitlines()]
    first = [e for e in events if e["event"] == "migration" and e["generation"] == 1]
    assert first and {(e["D"], e["P"], e["step"]) for e in first} == {(6, 1, 0)}, first
    assert "does not split over D=8" in first[0]["reason"]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("seed", [4, 43, 1005, 1102, 2008])  # 43: store outage; 1005, 1102: validation with joiners; 2008: kills in a migration and a join
def test_chaos_trial_sample_loses_nothing_and_stalls_within_bound(tmp_path: Path, seed: int) -> None:
    # these seeds are regressions found before trials drew gradient accumulation: run them as they were drawn then
    _check(run_trial(dataclasses.replace(draw(seed), accumulate=1), tmp_path))


@pytest.mark.timeout(480)
@pytest.mark.parametrize("seed", [192, 254])  # accumulation 2 at P=2 with two kills; 3 at P=2, the leader and two kills
def test_chaos_trial_with_gradient_accumulation_loses_nothing(tmp_path: Path, seed: int) -> None:
    trial = draw(seed)
    assert trial.accumulate > 1 and trial.pipeline_stages > 1  # a loss can land inside a window, mid-pipeline
    _check(run_trial(trial, tmp_path))


@pytest.mark.chaos
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", range(100))
def test_chaos_trial_loses_nothing_and_stalls_within_bound(tmp_path: Path, seed: int) -> None:
    _check(run_trial(draw(seed), tmp_path))


def test_a_shard_missing_from_a_step_is_accepted_only_for_a_member_killed_or_fenced_right_after_it() -> None:
    """The harness's accounting (``_killed_before_recording``): a member that trained step 4 but never wrote its
    record -- SIGKILLed (exit -9) or SIGSTOPped, declared dead and fenced on waking (exit 77) -- leaves its shard
    unrecorded; any other gap stays a failure. Seed 43 of the default sample once failed on a fenced member."""
    from chaos_harness import _killed_before_recording  # noqa: PLC0415

    trial = Trial(seed=0, instances=5, batch=48, samples=192, pipeline_stages=1, micro_batches=2, schedule="gpipe",
                  optimizer="sgd", val_every=0, after_fit=False, max_steps=5, faults=[])
    steps = [{"member": m, "step": s, "gen": 0, "replica": r, "ids": list(range(12))}
             for s in (1, 2, 3) for r, m in enumerate(["i0", "i1", "i2", "i3"])]
    steps += [{"member": m, "step": 4, "gen": 1, "replica": r, "ids": list(range(12))}
              for r, m in enumerate(["i0", "i1", "i2"])]
    for rc, accepted in ((77, True), (-9, True), (1, False)):
        report = {"events": [{"event": "exit", "member": "i3", "rc": rc}]}
        assert (_killed_before_recording(steps, trial, report) == {4: 12}) is accepted, rc
    assert _killed_before_recording(steps, trial, {"events": []}) == {}


def test_a_scale_family_keeps_every_draw_of_the_seed_but_the_instance_count() -> None:
    """``--instances 8`` runs the same seeds at another scale: the configuration and the faults stay the seed's,
    and the command that replays a failure says the scale (without it the replay would run the drawn 2-6)."""
    for seed in (0, 700, 1005):
        drawn, scaled = draw(seed), draw(seed, 8)
        assert dataclasses.replace(scaled, instances=drawn.instances, scaled=False) == drawn
        assert scaled.instances == 8 and scaled.replay().endswith(f"--seed {seed} --instances 8")
        assert drawn.replay().endswith(f"--seed {seed}")
