"""Process setup: how one worker process becomes a rank of the job, for every Trainer stage it runs.

Problem: a worker may be started by Lightning itself, by ``parcae agent`` or torchrun (ranks taken as given), by
``parcae run`` as a start-up candidate (its rank comes from the launch's roster, written once the candidates have
arrived; one left out of it becomes a standby: :mod:`lightning_parcae.runtime.startup`), or join a job that is
already training (its rank and shape come from the generation that admits it);
and a script may run several Trainer stages (``fit`` then ``validate``...) whose process groups must not collide
with the fit's, which may have migrated. This part sets the global rank and world size, creates the coordination
store, builds the process groups of a fresh generation (or waits as a joiner and builds the admitting
generation's), and installs the launcher's hooks on the Trainer: resume from the fallback checkpoint and the run
callback. The store, backend and collective timeout it chose are kept here for later rebuilds.

The strategy owns one :class:`ProcessSetup` and forwards Lightning's ``set_world_ranks`` / ``setup_environment``
to it. The process groups it builds, and a joiner's admitted layout, are handed to the
:class:`~lightning_parcae.training.layout.StageLayout`, which keeps them in the one
:class:`~lightning_parcae.training.stage_state.StageState`.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_parcae.contract import GENERATION_BASE_ENV, RUN_DIR_ENV
from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime.groups import ProcessGroups
from lightning_parcae.training import environment as launcher_env
from lightning_parcae.training.lightning_internals import checkpoint_connector, module_trainer
from lightning_parcae.training.namespaces import check_trainer, namespace

if TYPE_CHECKING:
    from lightning_parcae.training.layout import StageLayout
    from lightning_parcae.training.options import StrategyOptions

__all__ = ["ProcessSetup", "ProcessHost", "resume_once"]

_FIT = "fit"  # TrainerFn value (both namespaces)

log = logging.getLogger(__name__)

_GENERATION = [0]


def _next_generation() -> int:
    """A fresh generation number per Trainer run in this process (the base store may be reused)."""
    _GENERATION[0] += 1
    return _GENERATION[0] - 1


def resume_once(trainer: Any, path_for: Callable[[Any], Any]) -> None:
    """Make the Trainer's next checkpoint restore read ``path_for(<the path it was given>)``, once.

    Args:
        trainer: The Trainer whose checkpoint connector is patched (its ``resume_start``).
        path_for: Maps the ``ckpt_path`` Lightning resumes from (``None`` when none was given) to the one to read.
    """
    connector = checkpoint_connector(trainer)
    original = connector.resume_start

    def resume_start(checkpoint_path: Any = None, **kwargs: Any) -> None:
        connector.resume_start = original  # type: ignore[method-assign]
        original(path_for(checkpoint_path), **kwargs)

    connector.resume_start = resume_start  # type: ignore[method-assign]


class ProcessHost(Protocol):
    """What the process setup needs from the strategy: Lightning's rank and device facts, the cluster environment,
    the module, and the elastic runtime it creates (the strategy itself is also what Lightning's multiprocessing
    launcher and the runtime are given)."""

    options: "StrategyOptions"
    elastic_runtime: Any

    @property
    def cluster_environment(self) -> Any: ...

    @property
    def parallel_devices(self) -> Optional[list[Any]]: ...

    @property
    def lightning_module(self) -> Any: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def num_nodes(self) -> int: ...

    @property
    def root_device(self) -> Any: ...

    def set_world_ranks(self) -> None: ...


class ProcessSetup:
    """Ranks, store and process-group generations of one strategy (see the module docstring).

    Args:
        host: The strategy (Lightning's rank facts, cluster environment, module, elastic runtime).
        options: The strategy's options (backend, timeout, start method, P, elastic).
        layout: The stage layout, which keeps the groups built here and a joiner's admitted layout.
        ns_name: The strategy's Lightning namespace (its launcher classes and callbacks).

    Attributes:
        store: The coordination store (``None`` until the first ``setup_environment``).
        backend: The process-group backend (``None``: chosen by device at the first ``setup_environment``).
        timeout: The collective timeout (shortened under live reconfiguration).
    """

    def __init__(self, host: ProcessHost, options: "StrategyOptions", layout: "StageLayout", ns_name: str) -> None:
        self.host = host
        self.options = options
        self.layout = layout
        self.ns_name = ns_name
        self.store: Optional[dist.Store] = None
        self.backend: Optional[str] = options.process_group_backend
        self.timeout: timedelta = options.timeout
        self._fit_generation: Optional[int] = None  # last generation of an elastic fit (later stages count on)
        self._post_fit_stages = 0

    def lightning_launcher(self) -> Any:
        """Lightning's launcher for ``start_method``: ``popen`` re-runs the script per process, else multiprocessing."""
        s = self.host
        assert s.cluster_environment is not None
        ns = namespace(self.ns_name)
        if self.options.start_method == "popen":
            return ns.SubprocessScriptLauncher(s.cluster_environment, s.num_processes, s.num_nodes)
        return ns.MultiProcessingLauncher(s, start_method=self.options.start_method)

    def device(self) -> Any:
        """This process's device: entry ``LOCAL_RANK`` of the strategy's devices.

        Raises:
            ConfigurationError: when there are no devices yet, or fewer than ``LOCAL_RANK + 1``.
        """
        s = self.host
        devices = s.parallel_devices
        if not devices:
            raise ConfigurationError("ParcaeStrategy has no devices yet: pass it to a Trainer before use")
        rank = s.local_rank
        if rank >= len(devices):
            raise ConfigurationError(
                f"this process has LOCAL_RANK={rank} but the Trainer was given {len(devices)} device(s); start "
                f"{len(devices)} process(es) per machine or give the Trainer devices={rank + 1} or more"
            )
        return devices[rank]

    def set_world_ranks(self) -> None:
        """Derive global rank / world size from node rank, local rank and process count.

        Under live reconfiguration the launcher's (or agent's, or torchrun's) ``RANK`` / ``WORLD_SIZE`` are taken
        as given, so a script started with ``devices=1`` on each of N machines needs no ``num_nodes=N``. In a later
        Trainer stage after an elastic fit, the ranks of the fit's last generation are kept.
        """
        s = self.host
        er = s.elastic_runtime
        if er is not None and er.layout is not None and er.member in er.layout.members:
            # a later Trainer stage (validate/test after an elastic fit): the ranks of the fit's last generation,
            # not the launcher's start-up RANK/WORLD_SIZE (a joiner started as RANK=0 of WORLD_SIZE=1)
            self.set_ranks(er.layout.members.index(er.member), len(er.layout.members))
            return
        if s.cluster_environment is not None:
            if self.options.elastic and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                s.cluster_environment.set_global_rank(int(os.environ["RANK"]))
                s.cluster_environment.set_world_size(int(os.environ["WORLD_SIZE"]))
            else:
                s.cluster_environment.set_global_rank(s.node_rank * s.num_processes + s.local_rank)
                s.cluster_environment.set_world_size(s.num_nodes * s.num_processes)
        rank_zero_only.rank = s.global_rank

    def set_ranks(self, rank: int, world: int) -> None:
        """Make this process rank ``rank`` of ``world`` (cluster environment and rank-zero logging)."""
        s = self.host
        if s.cluster_environment is not None:
            s.cluster_environment.set_global_rank(rank)
            s.cluster_environment.set_world_size(world)
        rank_zero_only.rank = rank

    def build_groups(self, generation: int, rank: int, world: int, data_parallel: int, stages: int) -> ProcessGroups:
        """Build generation ``generation``'s process groups on the store (the caller hands them to the layout)."""
        return ProcessGroups(generation, rank, world, data_parallel, stages, self.store, self.backend or "gloo",
                             self.timeout, aborted=self._aborted).build()

    def use_timeout(self, timeout: timedelta) -> None:
        """From now on every collective is bounded by ``timeout`` (the current groups' operations too)."""
        self.timeout = timeout
        groups = self.layout.state.groups
        if groups is not None:
            groups.set_op_timeout(timeout)

    def _aborted(self) -> Optional[str]:
        """Why the generation being built was aborted by the heartbeats (None: it was not, or no live reconfiguration)."""
        er = self.host.elastic_runtime
        live = er.live if er is not None else None
        return live.abort_reason() if live is not None else None

    def before_environment(self) -> None:
        """Before Lightning's own environment setup: refuse a foreign Trainer, install the launcher's resume."""
        trainer = module_trainer(self.host.lightning_module)
        if trainer is not None:
            check_trainer(trainer, self.ns_name)
            self._install_launcher_resume(trainer)

    def setup_environment(self) -> None:
        """After Lightning's own environment setup: ranks, the store and this Trainer stage's process groups."""
        s = self.host
        stage = self.layout.state
        if s.elastic_runtime is not None and stage.groups is not None and stage.groups.built:
            # validate/test/predict after fit: the job runs on the generation fit ended in (its members, ranks and
            # groups); the launch's RANK / WORLD_SIZE and a rebuilt "generation 1" would be stale after any change
            return
        if not self.options.elastic and launcher_env.launcher_roster_key():
            raise ConfigurationError(
                "ParcaeStrategy(elastic=False) under `parcae run --elastic`: the launcher starts every worker as a "
                "start-up candidate whose rank comes from the launch's roster (PARCAE_ROSTER), which only the live-"
                "reconfiguration runtime reads; leave elastic at its default under the launcher, or run the job with "
                "`parcae run --restart-fallback` (fixed ranks, every change a restart)")
        s.set_world_ranks()
        world = s.world_size
        self.backend = self.backend or ("nccl" if s.root_device.type == "cuda" else "gloo")
        if self.options.elastic and s.elastic_runtime is None:
            from lightning_parcae.runtime.elastic import ElasticRuntime  # noqa: PLC0415

            s.elastic_runtime = ElasticRuntime(s, launcher_env.runtime_config(s.options.elastic_options))
            self.store = s.elastic_runtime.connect()
            self.timeout = min(self.timeout, timedelta(minutes=5))
            if s.elastic_runtime.config.roster_key and not s.elastic_runtime.joining:
                self._take_seat()
                world = s.world_size
            if s.elastic_runtime.joining:  # its shape comes from the generation that admits it
                self.timeout = s.elastic_runtime.stall_timeout  # everyone it meets is already running
                self._join()
                return
        p = len(stage.partition) if stage.partition else (self.options.pipeline_stages or 1)
        if world % p:
            raise ConfigurationError(
                f"pipeline_stages={p} does not divide devices x nodes = {world}; D = devices / P must be whole"
            )
        if self.store is None and world == 1:
            self.store = dist.HashStore()
        elif self.store is None:
            assert s.cluster_environment is not None
            self.store = dist.TCPStore(
                s.cluster_environment.main_address,
                s.cluster_environment.main_port,
                world,
                s.global_rank == 0,
                timeout=self.timeout,
            )
        if stage.groups is not None:  # a previous Trainer stage of this strategy left its generation up
            stage.groups.destroy()
        elif dist.is_initialized():
            dist.destroy_process_group()
        er = s.elastic_runtime
        after_fit = er is not None and er.layout is not None
        if after_fit:
            # validate/test/predict after an elastic fit: the members may have migrated (and joined) during fit,
            # so per-process Trainer-run counters disagree and low numbers are taken by the fit's generations.
            # Every member agrees on the fit's last generation; later Trainer stages count on from there.
            if self._fit_generation is None:
                self._fit_generation = int(er.generation)
            self._post_fit_stages += 1
            generation = self._fit_generation + self._post_fit_stages
        else:
            generation = int(os.environ.get(GENERATION_BASE_ENV, "0")) + _next_generation()
        self.layout.use_groups(self.build_groups(generation, s.global_rank, world, world // p, p))
        if er is not None and not after_fit:
            er.boot_register(generation, s.global_rank)

    def _take_seat(self) -> None:
        """A start-up candidate of ``parcae run``: its rank comes from the launch's roster, written once the
        candidates arrived (:mod:`lightning_parcae.runtime.startup`); one left out of it becomes a standby (the
        runtime's ``joining``) and the caller takes the join path."""
        er = self.host.elastic_runtime
        stage = self.layout.state
        roster = er.take_seat(len(stage.partition) if stage.partition else (self.options.pipeline_stages or 0))
        rank = roster.rank_of(er.member)
        if rank is not None:
            self.set_ranks(rank, roster.world)

    def _join(self) -> None:
        """A joiner: wait as a standby until admitted, receive state, build the admitting generation's groups."""
        s = self.host
        er = s.elastic_runtime
        assert er is not None
        rec = er.join_wait()
        layout = er.layout
        assert layout is not None
        rank = layout.members.index(er.member)
        self.set_ranks(rank, len(layout.members))
        # a model without a cuttable stack (stack_path "") keeps P = 1 (the strategy's max_pipeline_stages says so)
        self.layout.adopt_admitted(list(layout.partition), rec["stack_path"], list(rec["layer_names"]),
                                   list(rec.get("layer_times") or []), rec.get("outside"))
        try:
            self.layout.use_groups(self.build_groups(int(rec["generation"]), rank, len(layout.members),
                                                     layout.data_parallel, layout.pipeline_stages))
        except RuntimeError as exc:  # a member lost while the admitting generation formed
            er.admission.give_up(int(rec["generation"]), exc)

    def _install_launcher_resume(self, trainer: Any) -> None:
        """Under ``parcae run``: a ``fit`` without ``ckpt_path`` resumes from the launcher's checkpoint
        (``PARCAE_RESUME_CKPT``, set on a fallback relaunch); a ``ckpt_path`` the script gives wins."""
        path = launcher_env.launcher_resume_path() if launcher_env.under_launcher() else None
        if path is None or trainer.state.fn != _FIT:
            return

        def path_for(checkpoint_path: Any) -> Any:
            if checkpoint_path is None:
                log.info("resuming from the launcher's checkpoint %s", path)
            return checkpoint_path if checkpoint_path is not None else path

        resume_once(trainer, path_for)

    def add_launcher_callbacks(self, trainer: Any) -> None:
        """Under ``parcae run``: periodic checkpoints, the agreed stop of the restart fallback and progress/end
        events (:class:`~lightning_parcae.training.callbacks.ParcaeRunCallback`), unless the script added its own."""
        from lightning_parcae.training.callbacks import ParcaeRunCallbackMixin, callback_class  # noqa: PLC0415

        if not os.environ.get(RUN_DIR_ENV) or any(isinstance(cb, ParcaeRunCallbackMixin) for cb in trainer.callbacks):
            return
        trainer.callbacks.append(callback_class("run", self.ns_name)())
