"""The runtime's one typed configuration (lightning_parcae.runtime.config.RuntimeConfig)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime.config import RuntimeConfig


def _config(**kw: Any) -> RuntimeConfig:
    base: dict[str, Any] = dict(store_url="tcp://127.0.0.1:1", token=None, member="m", interval_s=60.0,
                                interval_steps=0, look_ahead=12, predictor="persistence", heartbeat_s=0.2,
                                dead_after_s=3.0, stall_after_s=60.0, throughput="measured")
    base.update(kw)
    return RuntimeConfig(**base)


def test_the_defaults_are_a_member_of_a_job_of_up_to_64_instances() -> None:
    c = _config()
    assert c.max_instances == 64 and not c.joining and c.run_dir is None and c.shared_cores is None
    assert c.max_exploration_share == 0.1 and c.policy == "liveput"
    assert c.stall_timeout == timedelta(seconds=60.0)


@pytest.mark.parametrize("kw, needle", [
    ({"stall_after_s": 0.0}, "stall_after_s must be > 0 seconds, got 0.0"),
    ({"throughput": "fast"}, "throughput='fast': use 'measured' or 'profile'"),
    ({"max_instances": 0}, "max_instances must be >= 1, got 0"),
    ({"max_exploration_share": 1.2}, "max_exploration_share=1.2: expected the largest fraction"),
    ({"max_exploration_share": -0.05}, "max_exploration_share=-0.05: expected the largest fraction"),
    ({"max_exploration_share": "10%"}, "max_exploration_share='10%': expected the largest fraction"),
    ({"policy": "greedy"}, "policy='greedy': use 'liveput' (plan over the forecast; the default) or 'reactive'"),
    ({"risk": -0.5}, "risk=-0.5: give the standard deviations of expected gain a departure"),
    ({"risk": float("nan")}, "risk=nan: give the standard deviations"),
    ({"risk": "high"}, "risk='high': give the standard deviations"),
    ({"min_gain": 1.0}, "min_gain=1.0: the least gain of a departure from the reactive shape is a fraction"),
    ({"min_gain": -0.01}, "min_gain=-0.01: the least gain"),
    ({"min_gain": "1%"}, "min_gain='1%': the least gain"),
    ({"min_gain": float("nan")}, "min_gain=nan: the least gain"),
])
def test_a_configuration_out_of_range_is_refused_naming_the_value(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        _config(**kw)
    assert needle in str(err.value)


def test_the_configuration_is_frozen() -> None:
    c = _config()
    with pytest.raises(AttributeError):
        c.member = "other"  # type: ignore[misc]


def test_the_strategys_exploration_cap_reaches_the_runtime_and_a_bad_one_is_refused_at_the_strategy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ParcaeStrategy(max_exploration_share=...)`` is one of the strategy's elastic options: checked when the
    strategy is built (naming the value), carried to the runtime's configuration by ``runtime_config``."""
    from lightning_parcae.training import environment
    from lightning_parcae.training.strategy import ParcaeStrategy

    monkeypatch.setenv("PARCAE_STORE", "tcp://127.0.0.1:5")
    assert ParcaeStrategy(elastic=False).elastic_options["max_exploration_share"] == 0.1
    planning = ParcaeStrategy(elastic=False, max_exploration_share=0.25).elastic_options
    assert environment.runtime_config(planning).max_exploration_share == 0.25
    with pytest.raises(ConfigurationError, match=r"max_exploration_share=2: expected .* in \[0, 1\]"):
        ParcaeStrategy(elastic=False, max_exploration_share=2)


def test_the_strategys_policy_reaches_the_runtime_and_an_unknown_one_is_refused_at_the_strategy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ParcaeStrategy(policy="reactive")`` -- the baseline the replays compare Parcae with -- is carried to the
    runtime's configuration; a misspelt one fails when the strategy is built, naming the choices."""
    from lightning_parcae.training import environment
    from lightning_parcae.training.strategy import ParcaeStrategy

    monkeypatch.setenv("PARCAE_STORE", "tcp://127.0.0.1:5")
    assert environment.runtime_config(ParcaeStrategy(elastic=False).elastic_options).policy == "liveput"
    planning = ParcaeStrategy(elastic=False, policy="reactive").elastic_options
    assert environment.runtime_config(planning).policy == "reactive"
    with pytest.raises(ConfigurationError, match="policy='parcae': use 'liveput'"):
        ParcaeStrategy(elastic=False, policy="parcae")


def test_the_strategys_risk_reaches_the_runtime_and_a_bad_one_is_refused_at_the_strategy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ParcaeStrategy(risk=...)``: how many standard deviations of expected gain the leader's departure from the
    reactive shape must clear; checked when the strategy is built, carried to the runtime's configuration."""
    from lightning_parcae.training import environment
    from lightning_parcae.training.strategy import ParcaeStrategy

    monkeypatch.setenv("PARCAE_STORE", "tcp://127.0.0.1:5")
    assert environment.runtime_config(ParcaeStrategy(elastic=False).elastic_options).risk == 1.0  # since stop 51
    assert environment.runtime_config(ParcaeStrategy(elastic=False, risk=1.5).elastic_options).risk == 1.5
    with pytest.raises(ConfigurationError, match=r"risk=-1: give .* a finite number >= 0"):
        ParcaeStrategy(elastic=False, risk=-1)


def test_the_strategys_least_gain_and_fit_charge_reach_the_runtime_and_bad_ones_are_refused_at_the_strategy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ParcaeStrategy(min_gain=..., charge_unmeasured=...)``: the two rules of stop 54 beside the risk rule (a
    departure must gain 1 % of the reactive plan; a bet on an unmeasured shape also clears the fit's error). Until
    stop 55 only the optimizer took them, so a user could neither loosen nor tighten them; now they are checked
    when the strategy is built and carried to the runtime's configuration and its decider."""
    from lightning_parcae.training import environment
    from lightning_parcae.training.strategy import ParcaeStrategy

    monkeypatch.setenv("PARCAE_STORE", "tcp://127.0.0.1:5")
    default = environment.runtime_config(ParcaeStrategy(elastic=False).elastic_options)
    assert (default.min_gain, default.charge_unmeasured) == (0.01, True)
    given = environment.runtime_config(
        ParcaeStrategy(elastic=False, min_gain=0.03, charge_unmeasured=False).elastic_options)
    assert (given.min_gain, given.charge_unmeasured) == (0.03, False)
    with pytest.raises(ConfigurationError, match=r"min_gain=1.5: the least gain .* in \[0, 1\)"):
        ParcaeStrategy(elastic=False, min_gain=1.5)
    with pytest.raises(ConfigurationError, match=r"charge_unmeasured='no': give True .* or False"):
        ParcaeStrategy(elastic=False, charge_unmeasured="no")  # type: ignore[arg-type]
