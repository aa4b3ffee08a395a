"""The launcher's contract as the training layer reads it (lightning_parcae.training.environment): the runtime's one
typed configuration is built here from the strategy's options and the worker's environment."""

from __future__ import annotations

import os

import pytest

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime import steptime
from lightning_parcae.training import environment
from lightning_parcae.training.options import StrategyOptions
from lightning_parcae.training.strategy import ParcaeStrategy


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in list(os.environ):
        if k.startswith("PARCAE_") or k in ("RANK", "WORLD_SIZE", steptime.STEP_TIMING_ENV):
            monkeypatch.delenv(k)
    return monkeypatch


def _planning() -> dict:
    return ParcaeStrategy(elastic=False).elastic_options


def test_the_runtime_needs_a_store_that_outlives_the_workers(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigurationError, match="needs a coordination store"):
        environment.runtime_config(_planning())


def test_the_launchers_contract_arrives_in_the_runtime_configuration(clean_env: pytest.MonkeyPatch,
                                                                    tmp_path) -> None:  # noqa: ANN001
    """Regression: ``max_instances`` never reached the runtime (it defaulted to 64); the watchdog override, the
    shared cores and the run dir were read by the runtime itself. All now come in one object."""
    for key, value in {"PARCAE_STORE": "tcp://127.0.0.1:5", "PARCAE_JOB_TOKEN": "t0k", "PARCAE_MEMBER": "i3.1",
                       "PARCAE_JOIN": "1", "PARCAE_RUN_DIR": str(tmp_path), "PARCAE_STALL_S": "7.5",
                       "PARCAE_SHARED_CORES": "2", environment.MAX_INSTANCES_ENV: "12"}.items():
        clean_env.setenv(key, value)
    planning = _planning()
    c = environment.runtime_config(planning)
    assert (c.store_url, c.token, c.member, c.joining, c.run_dir) == ("tcp://127.0.0.1:5", "t0k", "i3.1", True,
                                                                      str(tmp_path))
    assert c.stall_after_s == 7.5 and c.shared_cores == 2 and c.max_instances == 12
    assert c.interval_s == planning["interval_s"] and c.look_ahead == planning["look_ahead"]
    assert c.predictor == planning["predictor"] and c.throughput == planning["throughput"]


def test_without_the_launchers_overrides_the_strategys_options_hold(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("PARCAE_STORE", "tcp://127.0.0.1:5")
    planning = _planning()
    c = environment.runtime_config(planning)
    assert c.stall_after_s == planning["stall_after_s"] and c.max_instances == 64 and c.shared_cores is None
    assert not c.joining and c.token is None and c.member.endswith(f"-{os.getpid()}")


def test_the_step_timers_are_switched_on_by_the_launchers_variable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(steptime, "ON", False)
    StrategyOptions.resolve(**{**_all_defaults(), "elastic": False})
    assert steptime.ON is False
    clean_env.setenv(steptime.STEP_TIMING_ENV, "1")
    assert environment.launcher_step_timing()
    StrategyOptions.resolve(**{**_all_defaults(), "elastic": False})
    assert steptime.ON is True


def _all_defaults() -> dict:
    import inspect

    params = inspect.signature(ParcaeStrategy.__init__).parameters
    return {n: p.default for n, p in params.items() if n in StrategyOptions.names()}
