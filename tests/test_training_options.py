"""The strategy's options (training/options.py) and the op names of its collectives (training/collectives.py)."""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
from torch.distributed import ReduceOp

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.training.collectives import op_name
from lightning_parcae.training.options import StrategyOptions
from lightning_parcae.training.strategy import ParcaeStrategy

_LIGHTNING_OWN = {"self", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                  "precision_plugin"}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in list(os.environ):
        if k.startswith("PARCAE_") or k in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)
    return monkeypatch


def _under_launcher(mp: pytest.MonkeyPatch, tmp: Any, stages: str = "", interval: str = "") -> None:
    mp.setenv("PARCAE_RUN_DIR", str(tmp))
    mp.setenv("RANK", "0")
    mp.setenv("WORLD_SIZE", "2")
    if stages:
        mp.setenv("PARCAE_PIPELINE_STAGES", stages)
    if interval:
        mp.setenv("PARCAE_INTERVAL_S", interval)


def test_options_are_exactly_the_constructor_arguments_that_are_not_lightnings() -> None:
    """The strategy passes its options on by name; an option added to the signature but not to StrategyOptions (or
    the other way round) would be lost or fail at construction -- here it fails first."""
    params = set(inspect.signature(ParcaeStrategy.__init__).parameters)
    assert StrategyOptions.names() == params - _LIGHTNING_OWN


@pytest.mark.parametrize("kwargs, needle", [
    ({"pipeline_stages": 0}, "pipeline_stages must be >= 1, got 0"),
    ({"pipeline_stages": -3}, "got -3"),
    ({"micro_batches": 0}, "micro_batches must be >= 1, got 0"),
    ({"micro_batches": -1}, "got -1"),
    ({"throughput": "fast"}, "throughput must be 'measured' or 'profile', got 'fast'"),
    ({"schedule": "zb"}, "schedule must be '1f1b' or 'gpipe', got 'zb'"),
    ({"balance": [1, 2], "pipeline_stages": 3}, "balance=[1, 2] has 2 stages but pipeline_stages=3"),
    ({"balance": [4], "pipeline_stages": 2}, "has 1 stages"),
])
def test_strategy_names_the_bad_value_if_an_option_is_invalid(clean_env: pytest.MonkeyPatch, kwargs: dict,
                                                              needle: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        ParcaeStrategy(**kwargs)
    assert needle in str(err.value)


@pytest.mark.parametrize("given, balance, env, expected", [
    (None, None, "3", 3),      # the launcher's P
    (2, None, "3", 2),         # the script's P wins
    (None, [1, 1, 2], "3", 3),  # a balance fixes P (= its length)
    (None, [2, 2], "3", 2),
    (None, None, "auto", None),  # "auto": chosen from a profile
    (None, None, "0", None),   # invalid: ignored
    (None, None, "", None),
])
def test_pipeline_stages_come_from_launcher_unless_script_or_balance_gives_them(
        clean_env: pytest.MonkeyPatch, tmp_path: Any, given: Any, balance: Any, env: str, expected: Any) -> None:
    _under_launcher(clean_env, tmp_path, stages=env)
    s = ParcaeStrategy(pipeline_stages=given, balance=balance)
    assert s.pipeline_stages_option == expected == s.options.pipeline_stages
    assert s.balance == balance and (balance is None or s.balance is not balance)


@pytest.mark.parametrize("under, given, env, expected", [
    (True, None, "2.5", 2.5),
    (True, None, "", 60.0),
    (True, None, "-1", 60.0),  # invalid: the default
    (True, 7.0, "2.5", 7.0),   # the script's interval wins
    (False, None, "2.5", 60.0),  # outside the launcher its variables are not read
])
def test_planning_interval_comes_from_launcher_unless_given(clean_env: pytest.MonkeyPatch, tmp_path: Any,
                                                            under: bool, given: Any, env: str,
                                                            expected: float) -> None:
    if under:
        _under_launcher(clean_env, tmp_path, interval=env)
    elif env:
        clean_env.setenv("PARCAE_INTERVAL_S", env)
    s = ParcaeStrategy(interval_s=given)
    assert s.elastic_options["interval_s"] == expected
    assert set(s.elastic_options) == {"interval_s", "interval_steps", "look_ahead", "predictor", "heartbeat_s",
                                      "dead_after_s", "stall_after_s", "throughput", "max_exploration_share",
                                      "preemption_notice", "policy", "prior_profile", "risk", "min_gain",
                                      "charge_unmeasured"}


@pytest.mark.parametrize("given, env, expected", [
    (None, "1", True), (None, "0", False), (None, "", False), (None, "false", False), (None, "yes", True),
    (True, "0", True), (False, "1", False),
])
def test_elastic_follows_environment_unless_given(clean_env: pytest.MonkeyPatch, given: Any, env: str,
                                                  expected: bool) -> None:
    clean_env.setenv("PARCAE_ELASTIC", env)
    assert ParcaeStrategy(elastic=given).elastic is expected


def test_options_are_frozen(clean_env: pytest.MonkeyPatch) -> None:
    s = ParcaeStrategy(pipeline_stages=2)
    with pytest.raises(AttributeError):
        s.options.pipeline_stages = 3  # type: ignore[misc]


@pytest.mark.parametrize("given, name", [
    (None, "mean"), ("mean", "mean"), ("avg", "mean"), ("AVG", "mean"), ("sum", "sum"), ("Max", "max"),
    ("min", "min"), (ReduceOp.SUM, "sum"), (ReduceOp.MAX, "max"), (ReduceOp.MIN, "min"), (ReduceOp.AVG, "mean"),
    (ReduceOp.PRODUCT, "sum"),  # an op Lightning never asks for: summed, as before
])
def test_op_name_maps_strings_and_reduce_ops(given: Any, name: str) -> None:
    assert op_name(given) == name


@pytest.mark.parametrize("given", [True, False])
def test_preemption_notice_reaches_the_runtime_config(clean_env: pytest.MonkeyPatch, tmp_path: Any,
                                                      given: bool) -> None:
    """The strategy's ``preemption_notice`` is what the leader's optimizer prices departures with (the runtime's
    RuntimeConfig); default True: spot departures come with a notice and the leaver hands its state over."""
    from lightning_parcae.training.environment import runtime_config

    _under_launcher(clean_env, tmp_path, interval="2.0")
    clean_env.setenv("PARCAE_STORE", "tcp://127.0.0.1:1")
    assert ParcaeStrategy().elastic_options["preemption_notice"] is True
    s = ParcaeStrategy(preemption_notice=given)
    assert runtime_config(s.elastic_options).preemption_notice is given


@pytest.mark.parametrize("run_dir, elastic, restarts", [
    (True, "0", True),     # parcae run --restart-fallback
    (True, "1", False),    # parcae run --elastic (a script that turns live reconfiguration off keeps the error)
    (True, None, False),   # not the launcher's contract
    (False, "0", False),   # no parcae run at all
])
def test_only_the_launchers_restart_fallback_relaunches_for_a_batch_the_first_d_cannot_split(
        clean_env: pytest.MonkeyPatch, tmp_path: Any, run_dir: bool, elastic: Any, restarts: bool) -> None:
    """Under ``--elastic`` a worker's FALLBACK_EXIT relaunches with the same power-of-two D: reporting the batch
    and exiting there would repeat until ``--max-restarts``. Only the restart fallback chooses D from the report."""
    from lightning_parcae.training.environment import launcher_restarts  # noqa: PLC0415

    if run_dir:
        clean_env.setenv("PARCAE_RUN_DIR", str(tmp_path))
    if elastic is not None:
        clean_env.setenv("PARCAE_ELASTIC", elastic)
    assert launcher_restarts() is restarts
