"""The ``parcae`` command: sub-commands print what a user asked for and fail with exit code 2 and a clear message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_parcae.launch.cli import main


def test_cli_simulate_prints_table_and_writes_report_if_segment_trace(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    report, plot = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        ["simulate", "--trace", "ll_10_11", "--model-table", "bert", "--policy", "ideal,throughput,parcae",
         "--look-ahead", "8", "--report", str(report), "--plot", str(plot)]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for name in ("ideal", "throughput", "parcae"):
        assert name in out
    data = json.loads(report.read_text())
    assert set(data["policies"]) == {"ideal", "throughput", "parcae"}
    assert data["policies"]["ideal"]["samples"] >= data["policies"]["parcae"]["samples"] > 0
    assert data["settings"]["look_ahead"] == 8 and data["trace"]["intervals"] == 60
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_slices_hours_if_start_and_end_given(capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate", "--trace", "p3", "--policy", "ideal", "--start-hour", "1", "--end-hour", "1.5"]) == 0
    assert "30 intervals" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["simulate", "--trace", "/nonexistent/trace.csv"], "/nonexistent/trace.csv"),
        (["simulate", "--model-table", "gpt-9000"], "gpt-9000"),
        (["simulate", "--policy", "ideal,magic"], "magic"),
        (["simulate", "--look-ahead", "0"], "--look-ahead 0"),
        (["simulate", "--price", "-1", "--policy", "ideal"], "price=-1"),
        (["simulate", "--start-hour", "50", "--policy", "ideal"], "select no interval"),
        (["predict", "--horizon", "0"], "--horizon 0"),
        (["predict", "--predictors", "crystal-ball"], "crystal-ball"),
    ],
)
def test_cli_exits_2_with_message_if_bad_input(argv: list, needle: str, capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "error" in err


def test_cli_predict_prints_mae_per_predictor_if_segment_trace(capsys: pytest.CaptureFixture) -> None:
    assert main(["predict", "--trace", "hh_55_65", "--horizon", "4", "--predictors", "persistence"]) == 0
    out = capsys.readouterr().out
    assert "persistence" in out and "mean absolute error" in out
