"""benchmarks/bench_decision_rules.py: variants are parsed with the strategy's own checks, and each variant reaches
the simulated parcae run it names (no processes: the simulator over a committed profile)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_decision_rules  # noqa: E402

from lightning_parcae.errors import ConfigurationError  # noqa: E402


def test_variants_parse_into_option_dicts_checked_as_the_strategy_checks_them() -> None:
    assert bench_decision_rules.parse_variants("min_gain=0; min_gain=0.01,risk=0.5;") == [
        {"min_gain": 0.0}, {"min_gain": 0.01, "risk": 0.5}]


@pytest.mark.parametrize("text, needle", [
    ("min_gain=1", "min_gain='1': the least gain"),
    ("risk=-2", "risk='-2': give the standard deviations"),
    ("tail=3", "'tail=3' is not NAME=VALUE"),
    ("min_gain", "'min_gain' is not NAME=VALUE"),
    (" ; ", "give at least one variant"),
])
def test_a_bad_variant_is_refused_naming_it(text: str, needle: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        bench_decision_rules.parse_variants(text)
    assert needle in str(err.value)


def test_each_variant_reaches_the_simulated_parcae_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A least gain no plan can reach makes parcae live-reactive exactly (ratio 1) on every segment; the variants
    are run in the order given, over the committed profiles' first one."""
    seen: list[dict[str, float]] = []
    real = bench_decision_rules.bench_replay.forecast

    def spy(*args: object, **kw: object) -> dict[str, float]:
        seen.append({k: kw[k] for k in ("min_gain", "risk") if k in kw})  # type: ignore[misc]
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(bench_decision_rules.bench_replay, "forecast", spy)
    profile = sorted(bench_decision_rules.PROFILES.glob("*.json"))[0]
    rows = bench_decision_rules.study([profile], [{"min_gain": 0.99}, {"risk": 0.0, "min_gain": 0.0}], 6, tmp_path)
    assert len(rows) == len(bench_decision_rules.SEGMENTS)
    assert all(r["ratios"][0] == pytest.approx(1.0) for r in rows)
    assert seen[:2] == [{"min_gain": 0.99}, {"min_gain": 0.0, "risk": 0.0}]
