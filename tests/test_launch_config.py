"""The validated options of ``parcae run`` (``lightning_parcae.launch.config``): the wall-clock views of the trace."""

from __future__ import annotations

from pathlib import Path

from lightning_parcae.launch.config import DEFAULT_TIME_SCALE, RunConfig


def test_trace_seconds_are_divided_by_the_time_scale_and_the_checkpoint_is_in_the_run_dir(tmp_path: Path) -> None:
    cfg = RunConfig(instances=2, command=["python", "x.py"], run_dir=tmp_path, interval_s=60.0, grace_s=120.0,
                    time_scale=30.0)
    assert (cfg.wall_interval_s, cfg.wall_grace_s) == (2.0, 4.0)
    assert cfg.checkpoint == tmp_path / "ckpt" / "last.ckpt"
    assert RunConfig(instances=1, command=[], run_dir=tmp_path).time_scale == DEFAULT_TIME_SCALE
