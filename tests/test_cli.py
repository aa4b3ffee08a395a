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
    assert data["settings"]["risk"] == 1.0 and "risk 1;" in out  # the runtime's default
    assert data["settings"]["min_gain"] == 0.01 and "least gain 0.01" in out and data["settings"]["charge_unmeasured"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_slices_hours_if_start_and_end_given(capsys: pytest.CaptureFixture) -> None:
    assert main(["simulate", "--trace", "p3", "--policy", "ideal", "--start-hour", "1", "--end-hour", "1.5"]) == 0
    assert "30 intervals" in capsys.readouterr().out


@pytest.mark.parametrize("seg,cap", [("hh_55_65", 4), ("lh_80_90", 6), ("ll_10_11", 3)])
def test_cli_simulate_scales_the_trace_like_parcae_run_if_max_instances_given(
        seg: str, cap: int, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--max-instances`` replays the trace as ``parcae run --max-instances`` does (same counts per interval), so a
    run's profile.json can be priced on the cluster it ran on."""
    from lightning_parcae.launch.run import _load_schedule

    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", seg, "--model-table", "bert", "--policy", "ideal", "--max-instances",
                 str(cap), "--report", str(report)]) == 0
    assert f"up to {cap} instances" in capsys.readouterr().out
    from lightning_parcae.signals.traces import bundled_trace_path, load_trace, scaled

    counts = list(scaled(load_trace(str(bundled_trace_path(seg)), interval_s=60.0), cap).counts())
    assert counts == _load_schedule(seg, 60.0, cap)[1]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["simulate", "--max-instances", "0", "--policy", "ideal"], "--max-instances 0"),
        (["simulate", "--trace", "/nonexistent/trace.csv"], "/nonexistent/trace.csv"),
        (["simulate", "--model-table", "gpt-9000"], "gpt-9000"),
        (["simulate", "--policy", "ideal,magic"], "magic"),
        (["simulate", "--look-ahead", "0"], "--look-ahead 0"),
        (["simulate", "--price", "-1", "--policy", "ideal"], "price=-1"),
        (["simulate", "--risk", "-1", "--policy", "ideal"], "risk=-1.0: give the standard deviations"),
        (["simulate", "--min-gain", "1", "--policy", "ideal"], "--min-gain=1.0: the least gain of a departure"),
        (["simulate", "--start-hour", "50", "--policy", "ideal"], "select no interval"),
        (["simulate", "--cost-model", "artifact", "--preemption-notice", "--policy", "ideal"], "--preemption-notice"),
        (["predict", "--horizon", "0"], "--horizon 0"),
        (["predict", "--predictors", "crystal-ball"], "crystal-ball"),
    ],
)
def test_cli_exits_2_with_message_if_bad_input(argv: list, needle: str, capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "error" in err


def test_cli_simulate_prices_departures_as_the_runtime_does_unless_told_they_vanish(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Regression (issue 21): the runtime prices a noticed departure as the leaver's copy
    (``ParcaeStrategy(preemption_notice=True)``, the default) but ``parcae simulate --cost-model default`` priced
    every departure as a sudden loss, so its forecast paid checkpoint restarts the run never makes. Now the default
    cost model takes the notice unless ``--no-preemption-notice`` says instances vanish."""
    lost = {}
    for flag in ([], ["--no-preemption-notice"]):
        report = tmp_path / f"r{len(flag)}.json"
        assert main(["simulate", "--trace", "hh_55_65", "--model-table", "gpt-1.5b", "--cost-model", "default",
                     "--policy", "live-reactive", "--report", str(report), *flag]) == 0
        out = capsys.readouterr().out
        data = json.loads(report.read_text())
        assert data["settings"]["preemption_notice"] is (not flag)
        assert ("departures noticed" in out) is (not flag)
        lost[bool(flag)] = data["policies"]["live-reactive"]["lost_s"]
    assert lost[False] < lost[True]  # a stage whose holders all leave is copied from them, not restarted


def test_cli_predict_prints_mae_per_predictor_if_segment_trace(capsys: pytest.CaptureFixture) -> None:
    assert main(["predict", "--trace", "hh_55_65", "--horizon", "4", "--predictors", "persistence"]) == 0
    out = capsys.readouterr().out
    assert "persistence" in out and "mean absolute error" in out


def _skypilot(path: Path, counts: list, gap: float) -> str:
    path.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": counts}))
    return str(path)


def test_cli_predict_scores_zero_if_constant_trace_above_32(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Regression: every forecast was clipped to 32, so a constant 40-instance trace scored 8.0 instead of 0."""
    trace = _skypilot(tmp_path / "c40.json", [40] * 20, 60)
    assert main(["predict", "--trace", trace, "--horizon", "3"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines()[2:]]
    assert rows and all(float(r[1]) == 0.0 for r in rows), out
    assert main(["predict", "--trace", trace, "--horizon", "3", "--max-instances", "32", "--predictors", "persistence"]) == 0
    assert "8.000" in capsys.readouterr().out


def test_cli_predict_says_too_short_if_one_interval(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Regression: a one-interval trace printed ``nan`` and a numpy warning."""
    trace = _skypilot(tmp_path / "one.json", [12], 60)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy warning would now fail the test
        assert main(["predict", "--trace", trace]) == 2
    captured = capsys.readouterr()
    assert "too short" in captured.err and "at least 2 intervals" in captured.err
    assert "nan" not in captured.out


def test_cli_predict_uses_and_prints_native_interval_if_not_given(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Regression: a 300-s trace was silently resampled to 60 s and the output did not say which was used."""
    trace = _skypilot(tmp_path / "t300.json", [16] * 10 + [12] * 5 + [0] * 6 + [14] * 20, 300)
    assert main(["predict", "--trace", trace, "--horizon", "2", "--predictors", "persistence"]) == 0
    captured = capsys.readouterr()
    assert "41 intervals of 300 s" in captured.out and "warning" not in captured.err
    assert main(["predict", "--trace", trace, "--horizon", "2", "--predictors", "persistence", "--interval", "60"]) == 0
    captured = capsys.readouterr()
    assert "205 intervals of 60 s" in captured.out
    assert "warning" in captured.err and "300-s grid" in captured.err and "--interval 300" in captured.err


def test_cli_simulate_uses_native_interval_if_not_given(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = _skypilot(tmp_path / "t300.json", [16] * 4 + [12] * 4, 300)
    assert main(["simulate", "--trace", trace, "--policy", "ideal,throughput"]) == 0
    assert "8 intervals of 300 s" in capsys.readouterr().out


def test_cli_simulate_runs_parcae_at_the_risk_given(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--risk`` is the strategy's ``risk`` option for the simulated parcae policy: an unclearable one makes
    parcae the live-reactive baseline exactly, and the report records it."""
    report = tmp_path / "r.json"
    assert main(["simulate", "--trace", "ll_10_11", "--model-table", "gpt-1.5b", "--policy", "parcae,live-reactive",
                 "--risk", "1e9", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["settings"]["risk"] == 1e9 and "risk 1e+09" in capsys.readouterr().out
    assert data["policies"]["parcae"]["samples"] == data["policies"]["live-reactive"]["samples"]


def test_cli_simulate_runs_parcae_at_the_least_gain_given(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--min-gain`` is the strategy's ``min_gain`` for the simulated parcae policy: with none (0, and risk 0)
    parcae departs from reacting on lh_80_90 and trains more than live-reactive; a least gain no plan can reach
    (0.99 of the reactive plan's value) leaves it the live-reactive baseline exactly. ``--no-charge-unmeasured``
    is recorded."""
    got = {}
    for gain in ("0", "0.99"):
        report = tmp_path / f"r{gain}.json"
        assert main(["simulate", "--trace", "lh_80_90", "--model-table", "gpt-1.5b", "--policy",
                     "parcae,live-reactive", "--risk", "0", "--min-gain", gain, "--no-charge-unmeasured",
                     "--report", str(report)]) == 0
        data = json.loads(report.read_text())
        assert data["settings"]["min_gain"] == float(gain) and data["settings"]["charge_unmeasured"] is False
        assert f"least gain {float(gain):g}; fit error not charged" in capsys.readouterr().out
        got[gain] = (data["policies"]["parcae"]["samples"], data["policies"]["live-reactive"]["samples"])
    assert got["0"][0] > got["0"][1]
    assert got["0.99"][0] == got["0.99"][1] == got["0"][1]
