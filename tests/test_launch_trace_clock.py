"""``parcae run --trace-clock``: the trace's time starts at the launch (default) or at the first training step, so
that a replay's changes hit training, not start-up, however long start-up takes on the machine at hand.

Regression (issue 23's feature tests): on a loaded 2-core machine start-up took 19 s, the trace's notice at 20 s
(meant for training) arrived during start-up and relaunched everyone instead of migrating in place, and the test of
the in-place path saw no migration."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch_fakes import config
from lightning_parcae.launch.run import Launcher, build_parser


def _launcher(tmp_path: Path, clock: str) -> Launcher:
    launcher = Launcher(config(tmp_path, schedule=[2, 1], trace_clock=clock))
    launcher.event = lambda *a, **k: None  # type: ignore[method-assign]
    return launcher


def test_the_first_step_clock_stands_still_until_training_starts(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _launcher(tmp_path, "first-step")
    now = [1000.0]
    monkeypatch.setattr("lightning_parcae.launch.run.time.time", lambda: now[0])
    launcher.state.t0 = 1000.0
    launcher.state.launched(generation=0, resume_step=0, instances=2, now=now[0])
    now[0] = 1030.0  # 30 s of start-up
    assert launcher.trace_elapsed() == 0.0
    assert launcher.state.is_first_step(0, 1)  # the first step is reported: RUNNING
    assert launcher.trace_elapsed() == 0.0  # the trace starts now
    now[0] = 1005.0 + 30.0
    assert launcher.trace_elapsed() == 5.0


def test_the_launch_clock_counts_start_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = _launcher(tmp_path, "launch")
    monkeypatch.setattr("lightning_parcae.launch.run.time.time", lambda: 1030.0)
    launcher.state.t0 = 1000.0
    assert launcher.trace_elapsed() == 30.0


def test_the_option_is_parsed_and_checked() -> None:
    assert build_parser().parse_args(["--instances", "2", "--", "x"]).trace_clock == "launch"
    assert build_parser().parse_args(["--trace-clock", "first-step", "--instances", "2", "--", "x"]).trace_clock \
        == "first-step"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--trace-clock", "later", "--instances", "2", "--", "x"])
