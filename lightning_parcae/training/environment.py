"""The launcher's contract, read by the strategy itself: a script needs only ``strategy="parcae"``.

Problem: ``parcae run`` and ``parcae agent`` start every worker with torchrun-style variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``PORT``) plus Parcae's own (``PARCAE_STORE``,
``PARCAE_JOB_TOKEN``, ``PARCAE_RUN_DIR``, ``PARCAE_INTERVAL_S``, ``PARCAE_PIPELINE_STAGES``, ``PARCAE_RESUME_CKPT``,
...; see ``docs/run.md``). Until now a script had to copy four of them into its Trainer by hand, and a script that
did not (``Trainer(strategy="parcae")`` with no ``devices=``) crashed with an ``IndexError``: Lightning's default
``devices`` on a CPU is 1 while the launcher's ``LOCAL_RANK`` goes up to ``LOCAL_WORLD_SIZE - 1``.

Here the contract is read in one place:

* :class:`ParcaeEnvironment` (a Lightning ``ClusterEnvironment``, one class per Lightning namespace via
  :func:`environment_class`) gives Lightning the ranks, world size and rendezvous address; processes are created
  externally (by the launcher), never by Lightning;
* :func:`resolve_devices` takes the number of devices on this machine from ``LOCAL_WORLD_SIZE`` when the script
  gave none, and refuses a ``devices=`` that contradicts the launcher with an error that says what to change;
* :func:`launcher_interval_s`, :func:`launcher_pipeline_stages`, :func:`launcher_resume_path` read the planning
  interval, the first generation's P and the checkpoint of a fallback relaunch;
* :func:`runtime_config` builds the live-reconfiguration runtime's one typed configuration
  (:class:`~lightning_parcae.runtime.config.RuntimeConfig`) from the strategy's options and the launcher's contract
  (store, job token, member id, joining, run dir, watchdog override, shared cores, largest instance count): the
  runtime itself never reads the environment; :func:`launcher_step_timing` says whether the step timers are on.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Mapping, Optional, Union

import torch

from lightning_parcae.contract import (
    CHECKPOINT_DIR_ENV,
    ELASTIC_ENV,
    MAX_INSTANCES_ENV,
    INTERVAL_ENV,
    JOB_TOKEN_ENV,
    JOIN_ENV,
    MEMBER_ENV,
    PIPELINE_ENV,
    ROSTER_ENV,
    RESUME_ENV,
    RUN_DIR_ENV,
    SHARED_CORES_ENV,
    STALL_ENV,
    STORE_ENV,
)
from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.measured import DEFAULT_MAX_EXPLORATION_SHARE
from lightning_parcae.planning.policy import DEFAULT_RISK
from lightning_parcae.planning.shape_optimizer import DEFAULT_MIN_GAIN
from lightning_parcae.runtime.config import RuntimeConfig
from lightning_parcae.runtime.steptime import STEP_TIMING_ENV

__all__ = [
    "under_launcher",
    "launcher_interval_s",
    "launcher_pipeline_stages",
    "launcher_roster_key",
    "launcher_resume_path",
    "launcher_checkpoint_dir",
    "launcher_member",
    "launcher_restarts",
    "launcher_local_world_size",
    "launcher_step_timing",
    "runtime_config",
    "MAX_INSTANCES_ENV",
    "resolve_devices",
    "environment_class",
    "ParcaeEnvironmentMixin",
]



def under_launcher() -> bool:
    """Whether this process was started by ``parcae run`` / ``parcae agent`` (a store or run dir, and a rank)."""
    env = os.environ
    return bool(env.get(STORE_ENV) or env.get(RUN_DIR_ENV)) and "RANK" in env and "WORLD_SIZE" in env


def launcher_interval_s() -> Optional[float]:
    """The launcher's planning interval in wall seconds (``PARCAE_INTERVAL_S``), if set and valid."""
    raw = os.environ.get(INTERVAL_ENV)
    try:
        value = float(raw) if raw else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


def launcher_pipeline_stages() -> Union[int, str, None]:
    """P of this (re)launch from ``PARCAE_PIPELINE_STAGES``: an int, ``"auto"`` or None when unset/invalid."""
    raw = os.environ.get(PIPELINE_ENV, "").strip()
    if raw == "auto":
        return "auto"
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None


def launcher_resume_path() -> Optional[str]:
    """The checkpoint a fallback relaunch resumes from (``PARCAE_RESUME_CKPT``), when it exists -- a local file, or
    a checkpoint store's URL (the launcher resolved it to the newest complete checkpoint there)."""
    path = os.environ.get(RESUME_ENV)
    return path if path and ("://" in path or os.path.isfile(path)) else None


def launcher_roster_key() -> Optional[str]:
    """The start-up roster this worker waits for (``PARCAE_ROSTER``: a candidate of ``parcae run``), or None."""
    return os.environ.get(ROSTER_ENV) or None


def launcher_checkpoint_dir() -> Optional[str]:
    """The launcher's checkpoint directory (``--checkpoint-dir``: a path or fsspec URL), or None."""
    return os.environ.get(CHECKPOINT_DIR_ENV) or None


def launcher_member() -> str:
    """This process's member id (``PARCAE_MEMBER``; else hostname-pid)."""
    return os.environ.get(MEMBER_ENV) or f"{os.uname().nodename}-{os.getpid()}"


def launcher_restarts() -> bool:
    """Whether ``parcae run`` runs this worker under its restart fallback (``PARCAE_ELASTIC=0`` from the
    launcher: every change stops and relaunches the group), not live reconfiguration."""
    return bool(os.environ.get(RUN_DIR_ENV)) and os.environ.get(ELASTIC_ENV) == "0"


def launcher_local_world_size() -> Optional[int]:
    """Worker processes the launcher started on this machine (``LOCAL_WORLD_SIZE``)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None


_DEFAULT_MAX_INSTANCES = 64
"""The forecasts' upper bound when the launcher does not say (:data:`~lightning_parcae.contract.MAX_INSTANCES_ENV`)."""


def launcher_step_timing() -> bool:
    """Whether the step timers of :mod:`lightning_parcae.runtime.steptime` run (``LIGHTNING_PARCAE_STEP_TIMING``)."""
    return os.environ.get(STEP_TIMING_ENV, "0") not in ("", "0", "false")


def runtime_config(planning: Mapping[str, Any]) -> RuntimeConfig:
    """The elastic runtime's configuration: the strategy's planning options and the launcher's contract.

    Reads ``PARCAE_STORE`` / ``PARCAE_JOB_TOKEN`` / ``PARCAE_MEMBER`` / ``PARCAE_JOIN`` / ``PARCAE_RUN_DIR``,
    ``PARCAE_STALL_S`` (overrides ``stall_after_s``), ``PARCAE_SHARED_CORES``, :data:`MAX_INSTANCES_ENV` and
    :data:`ROSTER_ENV` (a start-up candidate).

    Args:
        planning: The strategy's planning options (``StrategyOptions.elastic_options``: ``interval_s``,
            ``interval_steps``, ``look_ahead``, ``predictor``, ``heartbeat_s``, ``dead_after_s``, ``stall_after_s``,
            ``throughput``, ``max_exploration_share``, ``preemption_notice``, ``policy``, ``prior_profile``, ``risk``,
            ``min_gain``, ``charge_unmeasured``).

    Raises:
        ConfigurationError: ``PARCAE_STORE`` is not set, or an option is out of range.
    """
    env = os.environ
    url = env.get(STORE_ENV)
    if not url:
        raise ConfigurationError(
            "ParcaeStrategy(elastic=True) needs a coordination store that outlives the workers: run the script "
            "under `parcae run` (which hosts one) or set PARCAE_STORE=tcp://host:port or etcd://host:port/prefix"
        )
    raw_max = env.get(MAX_INSTANCES_ENV, "").strip()
    return RuntimeConfig(
        store_url=url,
        token=env.get(JOB_TOKEN_ENV) or None,
        member=launcher_member(),
        joining=env.get(JOIN_ENV, "0") not in ("", "0", "false"),
        run_dir=env.get(RUN_DIR_ENV),
        interval_s=float(planning["interval_s"]),
        interval_steps=int(planning["interval_steps"]),
        look_ahead=int(planning["look_ahead"]),
        predictor=planning["predictor"],
        heartbeat_s=planning["heartbeat_s"],
        dead_after_s=planning["dead_after_s"],
        stall_after_s=float(env.get(STALL_ENV) or planning["stall_after_s"]),
        throughput=planning["throughput"],
        max_instances=int(raw_max) if raw_max.isdigit() and int(raw_max) >= 1 else _DEFAULT_MAX_INSTANCES,
        shared_cores=int(env.get(SHARED_CORES_ENV) or 0) or None,
        roster_key=launcher_roster_key(),
        max_exploration_share=planning.get("max_exploration_share", DEFAULT_MAX_EXPLORATION_SHARE),
        preemption_notice=bool(planning.get("preemption_notice", True)),
        policy=planning.get("policy", "liveput"),
        prior_profile=planning.get("prior_profile"),
        risk=planning.get("risk", DEFAULT_RISK),
        min_gain=planning.get("min_gain", DEFAULT_MIN_GAIN),
        charge_unmeasured=bool(planning.get("charge_unmeasured", True)),
    )


_UNKNOWN = object()


def _trainer_devices_flag() -> Any:
    """The ``devices`` argument the script passed to ``Trainer(...)`` (``_UNKNOWN`` when no Trainer call is on the
    stack; see :func:`~lightning_parcae.training.lightning_internals.trainer_devices_argument`)."""
    from lightning_parcae.training.lightning_internals import trainer_devices_argument  # noqa: PLC0415

    return trainer_devices_argument(_UNKNOWN)


def _count(flag: Any) -> Optional[int]:
    if isinstance(flag, int) and not isinstance(flag, bool):
        return flag if flag > 0 else None
    if isinstance(flag, str):
        s = flag.strip()
        if s.lstrip("-").isdigit():
            return int(s) if int(s) > 0 else None
        if "," in s:
            return len([p for p in s.split(",") if p.strip()])
        return None
    if isinstance(flag, (list, tuple)):
        return len(flag)
    return None


def resolve_devices(devices: Optional[list[torch.device]], requested: Any = _UNKNOWN) -> Optional[list[torch.device]]:
    """This machine's device list under the launcher: one entry per worker process it started here.

    Args:
        devices: the list Lightning derived from ``Trainer(devices=...)``.
        requested: the ``devices`` argument as the script gave it (default: read from the Trainer call).

    Returns:
        ``devices`` unchanged outside the launcher or when it already matches ``LOCAL_WORLD_SIZE``; otherwise,
        when the script gave no ``devices`` (``"auto"``), ``LOCAL_WORLD_SIZE`` devices of the same type.

    Raises:
        ConfigurationError: the script's ``devices=`` contradicts the launcher, or the machine has fewer
            accelerators than the launcher started workers.
    """
    want = launcher_local_world_size()
    if devices is None or not devices or want is None or not under_launcher():
        return devices
    if len(devices) == want:
        return devices
    if requested is _UNKNOWN:
        requested = _trainer_devices_flag()
    auto = requested in ("auto", None, -1, "-1") or (requested is _UNKNOWN and len(devices) == 1)
    if not auto:
        given = _count(requested)
        raise ConfigurationError(
            f"Trainer(devices={requested!r}) contradicts the launcher: it started {want} worker process(es) on this "
            f"machine (LOCAL_WORLD_SIZE={want}), each of which is one device of the job"
            + (f", but devices={requested!r} means {given}" if given is not None else "")
            + ". Remove devices= from the Trainer (ParcaeStrategy takes it from the launcher) or set "
            f"devices={want}"
        )
    kind = devices[0].type
    if kind == "cpu":
        return [torch.device("cpu")] * want
    if kind == "cuda":
        if torch.cuda.device_count() < want:
            raise ConfigurationError(
                f"the launcher started {want} workers on this machine but only {torch.cuda.device_count()} CUDA "
                f"device(s) are visible; start at most that many instances per machine"
            )
        return [torch.device("cuda", i) for i in range(want)]
    return [devices[0]] * want


class ParcaeEnvironmentMixin:
    """Lightning's view of a process started by ``parcae run`` / ``parcae agent``.

    Ranks come from ``RANK`` / ``WORLD_SIZE`` and may be changed in place (a live reconfiguration renumbers the
    members); ``LOCAL_RANK`` picks this process's device; the launcher creates the processes.
    """

    def __init__(self) -> None:
        super().__init__()
        self._global_rank = int(os.environ.get("RANK", "0"))
        self._world_size = int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def creates_processes_externally(self) -> bool:
        """Always: the launcher (or agent) starts every worker."""
        return True

    @property
    def main_address(self) -> str:
        """``MASTER_ADDR`` (loopback by default)."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """``MASTER_PORT``."""
        return int(os.environ.get("MASTER_PORT", "29500"))

    @staticmethod
    def detect() -> bool:
        """Whether the launcher's variables are present."""
        return under_launcher()

    def world_size(self) -> int:
        """Members of the current generation."""
        return self._world_size

    def set_world_size(self, size: int) -> None:
        """Set by the strategy when a generation changes."""
        self._world_size = int(size)

    def global_rank(self) -> int:
        """This member's rank in the current generation."""
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        """Set by the strategy when a generation changes."""
        self._global_rank = int(rank)

    def local_rank(self) -> int:
        """Index of this process's device on its machine (``LOCAL_RANK``)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def node_rank(self) -> int:
        """``GROUP_RANK`` (``NODE_RANK``), 0 by default."""
        return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Devices are checked by :func:`resolve_devices`; nothing else to check."""

    def teardown(self) -> None:
        """Nothing to undo (the launcher owns the processes)."""


@lru_cache(maxsize=None)
def environment_class(ns_name: str) -> type:
    """``ParcaeEnvironment`` for one Lightning namespace (a subclass of that namespace's ``ClusterEnvironment``)."""
    from lightning_parcae.training.namespaces import namespace  # noqa: PLC0415

    ns = namespace(ns_name)
    return type("ParcaeEnvironment", (ParcaeEnvironmentMixin, ns.ClusterEnvironment),
                {"__module__": __name__, "__doc__": ParcaeEnvironmentMixin.__doc__})


BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
"""Put on the workers' ``PYTHONPATH`` by the launcher: its ``sitecustomize`` registers ``strategy="parcae"``."""


def with_boot_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with :data:`BOOT_DIR` first on ``PYTHONPATH`` (a worker script need not import lightning_parcae).

    When this package runs from a source checkout (not from ``site-packages``), the checkout follows it, so that
    the workers import the same ``lightning_parcae`` as the launcher -- not another copy installed in their Python
    (a registration hook missing from that copy made ``strategy="parcae"`` unknown to the workers).
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(BOOT_DIR)))
    front = [BOOT_DIR]
    if os.path.basename(root) not in ("site-packages", "dist-packages"):
        front.append(root)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in front]
    env["PYTHONPATH"] = os.pathsep.join([*front, *rest])
    return env
