"""The live-reconfiguration runtime's configuration: one typed object, built above the runtime and handed to it.

Problem: the runtime needs the strategy's planning options (interval, look-ahead, predictor, heartbeats, the
watchdog) *and* what the launcher told this worker (the store, the job token, its member id, whether it joins a
running job, the run directory, the cores its machine's workers share, the largest instance count). Read from two
channels -- the strategy's arguments and ``os.environ`` reads scattered over the runtime -- an option could arrive
by one and be missed by the other (``max_instances`` never arrived). :class:`RuntimeConfig` is that whole set,
checked once; the training layer builds it (``lightning_parcae.training.environment.runtime_config``: the one
place that reads the launcher's environment) and nothing under ``runtime/`` reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.measured import DEFAULT_MAX_EXPLORATION_SHARE, check_exploration_share
from lightning_parcae.planning.policy import DEFAULT_RISK, check_risk
from lightning_parcae.planning.shape_optimizer import DEFAULT_MIN_GAIN, check_min_gain

__all__ = ["POLICIES", "RuntimeConfig", "check_policy"]

POLICIES = ("liveput", "reactive")
"""How the leader chooses a shape: ``liveput`` (plan over the forecast, migrations priced) or ``reactive`` (the
throughput-best shape for the interval's count: the baseline, ``parcae simulate``'s ``live-reactive``)."""


def check_policy(policy: object) -> str:
    """``policy`` if it is one of :data:`POLICIES`.

    Raises:
        ConfigurationError: Naming the value and the choices.
    """
    if policy not in POLICIES:
        raise ConfigurationError(f"policy={policy!r}: use 'liveput' (plan over the forecast; the default) or "
                                 "'reactive' (the throughput-best shape for each interval's count, the baseline)")
    return str(policy)


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything one process's :class:`~lightning_parcae.runtime.elastic.ElasticRuntime` is configured with.

    Owned by the runtime it is given to; frozen (nobody changes it after the training layer built it).

    Attributes:
        store_url: Coordination store URL (hosted by ``parcae run`` or an external etcd / TCPStore).
        token: Job token (records are signed) or None.
        member: This process's member id (stable across generations).
        interval_s: Planning interval in wall seconds (0: only ``interval_steps``).
        interval_steps: Planning interval in optimizer steps (0: only ``interval_s``).
        look_ahead: Intervals the liveput optimizer plans over.
        predictor: Predictor name (``persistence``, ``arima``, ``artifact``).
        heartbeat_s: Heartbeat period.
        dead_after_s: Silence after which a member is declared dead.
        stall_after_s: Progress watchdog: an operation of a generation (collective, point-to-point, rendezvous of
            a rebuilt group) that makes no progress this long fails and becomes a recovery (the launcher's
            ``PARCAE_STALL_S`` already applied).
        throughput: ``"measured"`` (price shapes by measurement and the fitted model, with the never-slower rules)
            or ``"profile"`` (the per-layer formula only; measurements are still recorded and saved).
        joining: Start as a standby that waits to be admitted (a process added to a running job).
        run_dir: The run directory of ``parcae run`` (events, profile), or None.
        max_instances: Upper bound of the forecasts.
        shared_cores: Cores this machine's workers share (the measured model's contention term), or None.
        roster_key: A start-up candidate of ``parcae run``: the store key of its launch's roster, which says whether
            it is a member of the first generation (and its rank) or a standby (:mod:`.startup`); None: the rank
            was given.
        max_exploration_share: Cap on the share of training wall time the leader spends in exploration tries
            (each try's migrations and its trial in the unmeasured shape; a try is refused while the share so
            far, the try included at its expected cost, would exceed it -- the first try excepted). In ``[0, 1]``:
            0 never explores, 1 is no cap; default 0.1 (see
            :class:`~lightning_parcae.planning.measured.ExplorationBudget`).
        preemption_notice: Departures come with a notice and the leaver hands its state over (spot instances:
            AWS gives two minutes, GCP 30 s; ``parcae run`` replays every drop of a trace as one): the optimizer
            prices a stage whose every replica leaves as a copy from the leavers, not a checkpoint restart. False
            where instances vanish without one: a D=1 shape then prices each departure as a restart.
        policy: ``"liveput"`` (the optimizer's plan over the forecast look-ahead) or ``"reactive"`` (the
            throughput-best shape for the count of the interval about to run; see :data:`POLICIES`).
        prior_profile: Path or fsspec URL of an earlier run's ``profile.json``: with ``throughput="measured"``
            the leader prices its first migrations by that run's fitted constants (and starts from its step times
            when they are this job's) instead of the loopback constants; see :mod:`~lightning_parcae.runtime.prior`.
            None: start from the loopback constants.
        risk: Standard deviations of expected gain (over the forecast's scenarios) the liveput policy's departure
            from the reactive shape must clear (default 1; 0 follows the expectation; see
            :meth:`~lightning_parcae.planning.shape_optimizer.LiveputOptimizer.decide`).
        min_gain: The least fraction of the reactive plan's expected value the liveput policy's departure must gain
            besides the risk rule (default 0.01; 0: none; see
            :data:`~lightning_parcae.planning.shape_optimizer.DEFAULT_MIN_GAIN`).
        charge_unmeasured: A departure to a shape not yet measured must also clear the fit's error there (default
            True; see :meth:`~lightning_parcae.planning.shape_optimizer.LiveputOptimizer.unmeasured_risk`).
        plan_ahead: The leader's planning-interval decisions run on a thread during the next step
            (:mod:`~lightning_parcae.runtime.plan_ahead`; False: at the step boundary, every member waiting).

    Raises:
        ConfigurationError: ``stall_after_s`` is not positive, ``throughput`` or ``policy`` is unknown,
            ``max_instances`` is below 1, ``max_exploration_share`` is not a number in ``[0, 1]`` or
            ``risk`` is not a number >= 0 or ``min_gain`` not one in ``[0, 1)``.
    """

    store_url: str
    token: Optional[str]
    member: str
    interval_s: float
    interval_steps: int
    look_ahead: int
    predictor: str
    heartbeat_s: float
    dead_after_s: float
    stall_after_s: float
    throughput: str
    joining: bool = False
    run_dir: Optional[str] = None
    max_instances: int = 64
    shared_cores: Optional[int] = None
    roster_key: Optional[str] = None
    max_exploration_share: float = DEFAULT_MAX_EXPLORATION_SHARE
    preemption_notice: bool = True
    policy: str = "liveput"
    prior_profile: Optional[str] = None
    risk: float = DEFAULT_RISK
    min_gain: float = DEFAULT_MIN_GAIN
    charge_unmeasured: bool = True
    plan_ahead: bool = True

    def __post_init__(self) -> None:
        if not self.stall_after_s > 0:
            raise ConfigurationError(f"stall_after_s must be > 0 seconds, got {self.stall_after_s}")
        if self.throughput not in ("measured", "profile"):
            raise ConfigurationError(f"throughput={self.throughput!r}: use 'measured' or 'profile'")
        if self.max_instances < 1:
            raise ConfigurationError(f"max_instances must be >= 1, got {self.max_instances}")
        check_exploration_share(self.max_exploration_share)
        check_policy(self.policy)
        check_risk(self.risk)
        check_min_gain(self.min_gain)

    @property
    def stall_timeout(self) -> timedelta:
        """The progress watchdog's bound as a group timeout (see ``stall_after_s``)."""
        return timedelta(seconds=self.stall_after_s)
