"""A previous run's profile as the starting prices (lightning_parcae.runtime.prior): reading and checking the file,
which of its measurements apply to this job, and the leader's first decision with and without it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch.distributed as dist

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.measured import PROFILE_FORMAT
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.generation import GenerationRecords
from lightning_parcae.runtime.prior import read_prior_profile
from lightning_parcae.runtime.shape_choice import RUNTIME_CONSTANTS, ShapeChooser
from lightning_parcae.training.strategy import ParcaeStrategy
from test_runtime_shape_choice import _config, _host, _measure_2x2_faster, _slow_moves, _state


def _leader(tmp: Path, moves: list[dict[str, Any]], coord: Coordinator, events: list, batch: int = 48,
            **config: Any) -> ShapeChooser:
    host = _host([0.0116] + [0.048] * 8 + [0.03], batch=batch, max_stage_memory_bytes=2.5e5)
    state = _state(("a", "b", "c", "d"), (3, 3, 2, 2), 10)
    cfg = _config(look_ahead=12, interval_s=2.0, max_instances=4, run_dir=str(tmp), **config)
    return ShapeChooser(host, state, cfg, GenerationRecords(host, state), coord=coord,  # type: ignore[arg-type]
                        migrations=moves, event=lambda name, **kw: events.append((name, kw)))


def _earlier_run(tmp: Path) -> Path:
    """The profile.json of a run whose migrations took ~30 s each and which measured 2x2 10 % faster than 1x4."""
    run = tmp / "earlier"
    run.mkdir()
    old = _leader(run, _slow_moves(30.0), Coordinator(dist.HashStore()), [])
    _measure_2x2_faster(old)
    old.save_profile()
    return run / "profile.json"


def test_a_first_move_is_priced_by_the_earlier_runs_migration_costs(tmp_path: Path) -> None:
    """Regression (issue 21, stop 48, 0.25 Gbps replay of lh_80_90): a fresh job prices its first migration at the
    loopback constants (30 ms, 10 Gbps) and moves 1x4 -> 2x2 for a 10 % gain although its moves take ~30 s; with
    the profile of an earlier run of the same job it knows that before the first move, and stays."""
    prior = _earlier_run(tmp_path)
    fresh = _leader(tmp_path, [], Coordinator(dist.HashStore()), [])
    _measure_2x2_faster(fresh)
    assert fresh.choose(4, 4, observe=True) == (2, 2)  # the failure the prior fixes: loopback prices move at once
    events: list = []
    primed = _leader(tmp_path, [], Coordinator(dist.HashStore()), events, prior_profile=str(prior))
    model = primed.model()
    assert model is not None and model.measured(2, 2) is not None  # the same job: its step times are taken too
    assert primed.fitted_constants() == read_prior_profile(str(prior)).constants != RUNTIME_CONSTANTS
    assert primed.choose(4, 4, observe=True) == (1, 4)
    (ev,) = [kw for name, kw in events if name == "prior_profile"]
    assert ev["shapes"] == ["1,4", "2,2"] and ev["step_times_not_used"] is None
    # the file is the event's ``profile``: a ``source`` field would replace the emitter's name in events.jsonl
    assert ev["profile"] == str(prior) and "source" not in ev


def test_another_jobs_prior_gives_its_migration_costs_but_not_its_step_times(tmp_path: Path) -> None:
    """Step times of another global batch would price every shape wrong: only the constants are taken, and the
    event says why."""
    prior = _earlier_run(tmp_path)
    events: list = []
    other = _leader(tmp_path, [], Coordinator(dist.HashStore()), events, batch=96, prior_profile=str(prior))
    model = other.model()
    assert model is not None and model.measured_shapes() == []
    assert other.fitted_constants() == read_prior_profile(str(prior)).constants
    (ev,) = [kw for name, kw in events if name == "prior_profile"]
    assert ev["shapes"] == [] and "global batch 48 in the prior, 96 in this job" in ev["step_times_not_used"]


def test_this_runs_published_measurements_win_over_the_prior(tmp_path: Path) -> None:
    """A new leader of this run starts from what the previous leader published (fitted on top of the prior), not
    from the earlier run's file again."""
    prior = _earlier_run(tmp_path)
    coord = Coordinator(dist.HashStore())
    first = _leader(tmp_path, _slow_moves(60.0), coord, [], prior_profile=str(prior))
    assert first.model() is not None
    first.save_profile()
    events: list = []
    second = _leader(tmp_path, [], coord, events, prior_profile=str(prior))
    assert second.model() is not None
    assert second.fitted_constants() == first.fitted_constants() != read_prior_profile(str(prior)).constants
    assert not [kw for name, kw in events if name == "prior_profile"]


def test_a_prior_is_read_through_fsspec(tmp_path: Path) -> None:
    """A cluster keeps its profiles where its checkpoints are (object storage): any URL fsspec opens works."""
    raw = json.loads(_earlier_run(tmp_path).read_text())
    with fsspec.open("memory://profiles/job/profile.json", "w") as f:
        json.dump(raw, f)
    got = read_prior_profile("memory://profiles/job/profile.json")
    assert got.constants.bandwidth_bytes_per_s == raw["migration_constants"]["bandwidth_bytes_per_s"]
    assert got.step_times_for(48, 4, raw["layer_bytes"])[0].keys() == raw["shapes"].keys()
    shapes, why = got.step_times_for(48, 4, [b * 2 for b in raw["layer_bytes"]])
    assert shapes == {} and why is not None and "another model" in why
    shapes, why = got.step_times_for(48, 8, raw["layer_bytes"])
    assert shapes == {} and why is not None and "micro-batches 4 in the prior, 8 in this job" in why


@pytest.mark.parametrize("content, expected", [
    (None, "cannot be read"),
    ("not json {", "cannot be read"),
    (json.dumps({"layers": [1, 2]}), "is not a measured profile"),
    (json.dumps({"format": PROFILE_FORMAT, "layer_ms": [1.0]}), "has no valid migration_constants"),
    (json.dumps({"format": PROFILE_FORMAT, "migration_constants": {"bandwidth": 1}}), "has no valid migration"),
    (json.dumps({"format": PROFILE_FORMAT, "migration_constants": {"bandwidth_bytes_per_s": 0.0}}),
     "has no valid migration"),
])
def test_a_bad_prior_is_refused_naming_the_file_and_the_fix(tmp_path: Path, content: Any, expected: str) -> None:
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigurationError, match=expected) as err:
        read_prior_profile(str(path))
    assert str(path) in str(err.value) and "profile.json an earlier `parcae run` wrote" in str(err.value)


def test_the_strategy_checks_its_prior_when_it_is_built(tmp_path: Path) -> None:
    """A mistyped path fails when the strategy is built, not at the first decision (where the leader would have to
    start from the very loopback prices the option replaces)."""
    with pytest.raises(ConfigurationError, match="nope.json.*cannot be read"):
        ParcaeStrategy(prior_profile=str(tmp_path / "nope.json"))
    prior = _earlier_run(tmp_path)  # a Path is fine: kept as a string for the runtime's config
    assert ParcaeStrategy(prior_profile=prior).elastic_options["prior_profile"] == str(prior)  # type: ignore[arg-type]

def test_a_prior_that_vanished_after_the_check_is_logged_and_the_leader_starts_at_loopback(tmp_path: Path) -> None:
    """Read once more by the leader (a new leader may start long after the strategy was built): a store outage then
    is an event and a warning, not a crashed leader -- the job refits the constants from its own migrations."""
    prior = _earlier_run(tmp_path)
    events: list = []
    ch = _leader(tmp_path, [], Coordinator(dist.HashStore()), events, prior_profile=str(prior))
    prior.unlink()
    assert ch.model() is not None and ch.fitted_constants() == RUNTIME_CONSTANTS
    (ev,) = [kw for name, kw in events if name == "prior_profile"]
    assert "cannot be read" in ev["error"]
