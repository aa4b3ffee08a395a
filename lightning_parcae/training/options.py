"""The strategy's options: what a user configures, checked once and completed from the launcher.

Problem: ``ParcaeStrategy`` takes some twenty options, given in a script, on a LightningCLI command line or not at
all. Several must agree with each other (an explicit ``balance`` fixes P), several are refused outright when out of
range (with an error that names the value), and several default to what ``parcae run`` / ``parcae agent`` told the
worker (the first generation's P, the planning interval, whether the job is elastic) rather than to a constant.
:class:`StrategyOptions` is that resolved set: built by :meth:`StrategyOptions.resolve` from the constructor's
arguments, frozen afterwards. The constructor's signature (and its docstring's ``Args``) stay on the strategy,
where LightningCLI / jsonargparse read them. Resolving also switches this process's step timers on
(:func:`lightning_parcae.runtime.steptime.enable`) when the launcher asks for them
(``LIGHTNING_PARCAE_STEP_TIMING``), so the runtime never reads the environment for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Optional

from lightning_parcae.contract import ELASTIC_ENV
from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.measured import DEFAULT_MAX_EXPLORATION_SHARE, check_exploration_share
from lightning_parcae.planning.policy import DEFAULT_RISK, check_risk
from lightning_parcae.planning.shape_optimizer import DEFAULT_MIN_GAIN, check_min_gain
from lightning_parcae.runtime import steptime
from lightning_parcae.runtime.config import check_policy
from lightning_parcae.runtime.prior import read_prior_profile
from lightning_parcae.training import environment as launcher_env

__all__ = ["StrategyOptions"]

_DEFAULT_INTERVAL_S = 60.0


@dataclass(frozen=True)
class StrategyOptions:
    """The resolved options of one strategy (see :class:`~lightning_parcae.training.strategy.ParcaeStrategy` for
    what each one means).

    Attributes:
        pipeline_stages: P as configured: the given value, ``len(balance)`` when a balance is given, the launcher's
            P under ``parcae run`` when neither is, else ``None`` (chosen from a profile).
        interval_s: The planning interval in wall seconds: given, else the launcher's, else 60.
        elastic: Live reconfiguration on: given, else ``PARCAE_ELASTIC``.
    """

    pipeline_stages: Optional[int]
    micro_batches: int
    schedule: str
    layers_attr: Optional[str]
    balance: Optional[list[int]]
    max_stage_memory_bytes: Optional[int]
    optimizer_state_factor: float
    profile_repeats: int
    start_method: str
    process_group_backend: Optional[str]
    timeout: timedelta
    elastic: bool
    interval_s: float
    interval_steps: int
    look_ahead: int
    predictor: str
    heartbeat_s: float
    dead_after_s: float
    stall_after_s: float
    max_pipeline_stages: Optional[int]
    throughput: str
    max_exploration_share: float = DEFAULT_MAX_EXPLORATION_SHARE
    preemption_notice: bool = True
    policy: str = "liveput"
    prior_profile: Optional[str] = None
    risk: float = DEFAULT_RISK
    min_gain: float = DEFAULT_MIN_GAIN
    charge_unmeasured: bool = True

    @classmethod
    def resolve(cls, **given: Any) -> "StrategyOptions":
        """Complete the constructor's arguments from the launcher, check them, and freeze them.

        Args:
            **given: Every option of the strategy's constructor except Lightning's own (accelerator, devices,
                cluster environment, checkpoint IO, precision), by the constructor's names.

        Raises:
            ConfigurationError: naming the option, the value given and what is expected.
        """
        under = launcher_env.under_launcher()
        stages, balance = given["pipeline_stages"], given["balance"]
        if stages is None and balance is None and under:
            from_launcher = launcher_env.launcher_pipeline_stages()
            stages = from_launcher if isinstance(from_launcher, int) else None
        if given["interval_s"] is None:
            given["interval_s"] = (launcher_env.launcher_interval_s() if under else None) or _DEFAULT_INTERVAL_S
        _check(stages, given["micro_batches"], given["throughput"], given["schedule"], balance)
        check_policy(given.get("policy", "liveput"))
        if given.get("prior_profile") is not None:
            read_prior_profile(str(given["prior_profile"]))  # a bad file fails here, naming the fix, not mid-run
            given["prior_profile"] = str(given["prior_profile"])
        if "risk" in given:
            given["risk"] = check_risk(given["risk"])
        if "min_gain" in given:
            given["min_gain"] = check_min_gain(given["min_gain"])
        if "charge_unmeasured" in given and not isinstance(given["charge_unmeasured"], bool):
            raise ConfigurationError(f"charge_unmeasured={given['charge_unmeasured']!r}: give True (a departure to a "
                                     "shape not yet measured must also clear the fit's error; the default) or False")
        if "max_exploration_share" in given:
            given["max_exploration_share"] = check_exploration_share(given["max_exploration_share"])
        if given["elastic"] is None:
            given["elastic"] = os.environ.get(ELASTIC_ENV, "0") not in ("", "0", "false")
        if launcher_env.launcher_step_timing():  # the launcher's debugging switch: this process times its steps
            steptime.enable()
        given.update(pipeline_stages=stages if balance is None else len(balance), elastic=bool(given["elastic"]),
                     balance=list(balance) if balance is not None else None)
        return cls(**given)

    @classmethod
    def names(cls) -> frozenset[str]:
        """The options' names: the strategy constructor's arguments that are not Lightning's own."""
        return frozenset(f.name for f in fields(cls))

    @property
    def elastic_options(self) -> dict[str, Any]:
        """The strategy's planning options of the elastic runtime (with the launcher's contract they make its
        :class:`~lightning_parcae.runtime.config.RuntimeConfig`: ``training.environment.runtime_config``)."""
        return dict(
            interval_s=self.interval_s, interval_steps=self.interval_steps, look_ahead=self.look_ahead,
            predictor=self.predictor, heartbeat_s=self.heartbeat_s, dead_after_s=self.dead_after_s,
            stall_after_s=self.stall_after_s, throughput=self.throughput,
            max_exploration_share=self.max_exploration_share, preemption_notice=self.preemption_notice,
            policy=self.policy, prior_profile=self.prior_profile, risk=self.risk, min_gain=self.min_gain,
            charge_unmeasured=self.charge_unmeasured,
        )


def _check(stages: Optional[int], micro_batches: int, throughput: str, schedule: str,
           balance: Optional[list[int]]) -> None:
    if stages is not None and stages < 1:
        raise ConfigurationError(f"pipeline_stages must be >= 1, got {stages}")
    if micro_batches < 1:
        raise ConfigurationError(f"micro_batches must be >= 1, got {micro_batches}")
    if throughput not in ("measured", "profile"):
        raise ConfigurationError(f"throughput must be 'measured' or 'profile', got {throughput!r}")
    if schedule not in ("1f1b", "gpipe"):
        raise ConfigurationError(f"schedule must be '1f1b' or 'gpipe', got {schedule!r}")
    if balance is not None and stages is not None and len(balance) != stages:
        raise ConfigurationError(f"balance={balance} has {len(balance)} stages but pipeline_stages={stages}")
