"""The reconfiguration state machine: legal transitions, timing, and the transition callback."""

from __future__ import annotations

import pytest

from lightning_parcae.runtime.lifecycle import IllegalTransitionError, Lifecycle, Phase


def test_lifecycle_walks_the_planned_migration_path_if_transitions_are_legal() -> None:
    seen: list[tuple[str, str]] = []
    life = Lifecycle("m0", on_transition=lambda old, new, spent, info: seen.append((old.value, new.value)))
    for phase in (Phase.TRAINING, Phase.PLANNING, Phase.MIGRATING, Phase.TRAINING, Phase.STOPPED):
        assert life.to(phase) >= 0.0
    assert seen == [("starting", "training"), ("training", "planning"), ("planning", "migrating"),
                    ("migrating", "training"), ("training", "stopped")]
    assert [h[1] for h in life.history] == ["training", "planning", "migrating", "training", "stopped"]


def test_lifecycle_raises_if_a_standby_tries_to_train_before_it_migrated() -> None:
    life = Lifecycle("joiner")
    life.to(Phase.STANDBY)
    with pytest.raises(IllegalTransitionError, match="standby -> training"):
        life.to(Phase.TRAINING)


def test_lifecycle_raises_if_a_fallen_back_process_tries_to_keep_training() -> None:
    life = Lifecycle("m1")
    life.to(Phase.TRAINING)
    life.to(Phase.RECOVERING)
    life.to(Phase.FALLBACK)
    with pytest.raises(IllegalTransitionError):
        life.to(Phase.TRAINING)
    assert Lifecycle.allowed(Phase.FALLBACK, Phase.STOPPED)


def test_lifecycle_passes_info_and_time_spent_to_the_callback_if_given() -> None:
    got: list[tuple[float, dict]] = []
    life = Lifecycle("m0", on_transition=lambda old, new, spent, info: got.append((spent, info)))
    life.to(Phase.TRAINING, generation=3)
    assert got[0][1] == {"generation": 3} and got[0][0] >= 0.0
