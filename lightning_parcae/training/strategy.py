"""ParcaeStrategy: D x P (data x pipeline parallel) training of an unchanged LightningModule.

Problem: Parcae moves a job between shapes (D pipelines of P stages) as spot instances come and go. The foundation
is a strategy that trains an ordinary LightningModule at a *fixed* shape with exactly the result a single process
would get for the same global batch, and whose process groups, stage modules, data order and checkpoints are all
addressable so that a later issue can rebuild them in place.

How a training step runs (see ``docs/strategy.md`` for the user-facing version):

1. Every stage of pipeline ``r`` loads the same batch: slice ``r`` of the global batch (see ``runtime.data``).
2. The batch is split into M micro-batches. Stage 0 calls the user's ``training_step`` on each micro-batch with the
   layer stack replaced by a proxy that runs only stage 0's layers and stops the step there; the activation goes to
   stage 1. Middle stages run their layers on what they receive. The last stage calls the user's
   ``training_step`` with the proxy feeding the received activation through its layers, so the user's own loss
   code runs on the real output. GPipe or 1F1B orders these forwards and the matching backwards.
3. Each micro-batch loss is scaled by ``1 / (M * accumulate_grad_batches)`` before its backward, so the summed
   gradients equal the single-process gradient of the pipeline's batch.
4. The other stages then re-run the user's step on the last stage's outputs (broadcast in the pipeline group,
   no grad) so that ``self.log``, torchmetrics and the returned loss are identical on every rank; log calls of the
   M micro-steps are merged into one per name (mean / sum / max / min as ``reduce_fx`` says).
5. Lightning's ``zero_grad`` runs between ``training_step`` and ``backward``, so the step's gradients are kept
   aside and put back in :meth:`ParcaeStrategy.backward`, which then averages every stage's gradients over the D
   replicas of that stage (skipped while Lightning accumulates). Clipping uses the norm over *all* stages. Only
   then does the optimizer step (two-phase: no stage updates before every stage has its reduced gradients).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ReduceOp
from torch.optim import Optimizer

from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_parcae.contract import RUN_DIR_ENV, GENERATION_BASE_ENV, ELASTIC_ENV
from lightning_parcae.errors import ConfigurationError, ForeignTrainerError
from lightning_parcae.runtime.groups import ProcessGroups
from lightning_parcae.runtime.liveness import guarded
from lightning_parcae.runtime.pipeline import (
    P2P,
    StageProxy,
)
from lightning_parcae.training import environment as launcher_env
from lightning_parcae.training.checkpointing import StrategyCheckpoints
from lightning_parcae.training.data_path import DataPath
from lightning_parcae.training.layout import StageLayout
from lightning_parcae.training.profiling import LayerProfiler
from lightning_parcae.training.step_runner import StepRunner
from lightning_parcae.training.namespaces import IMPORT_HINT, namespace, namespace_of

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["ParcaeStrategy", "ParcaeStrategyMixin", "strategy_class", "check_trainer"]

_FIT, _TRAINING, _PREDICTING = "fit", "train", "predict"  # TrainerFn / RunningStage values (both namespaces)

log = logging.getLogger(__name__)


def check_trainer(trainer: Any, ns_name: str = "pytorch_lightning") -> None:
    """Refuse a Trainer of the other Lightning namespace (or anything that is not a Trainer of ``ns_name``).

    Raises:
        ForeignTrainerError: naming the import to use instead.
    """
    found = namespace_of(trainer)
    if found != ns_name or not isinstance(trainer, namespace(ns_name).pl.Trainer):
        hint = IMPORT_HINT.get(found or "", "a Lightning Trainer")
        raise ForeignTrainerError(
            f"this ParcaeStrategy was built for {ns_name}, but got a {type(trainer).__name__} from "
            f"{type(trainer).__module__!r}. With that Trainer use {hint}"
        )


class ParcaeStrategyMixin:
    """Data-parallel x pipeline-parallel training with exact single-process semantics.

    Args:
        pipeline_stages: P; ``None``: under ``parcae run`` the launcher's ``--pipeline-stages``, otherwise P is
            picked from a short per-layer profile (see
            :func:`~lightning_parcae.runtime.partition.choose_pipeline_stages`). D = devices / P. A model without a
            layer stack the pipeline can cut trains at P = 1 (see ``docs/strategy.md``).
        micro_batches: M, micro-batches per pipeline batch (the pipeline batch is global batch / D).
        schedule: ``"1f1b"`` (default, at most P micro-batches of activations alive) or ``"gpipe"``.
        layers_attr: dotted path of the ``nn.Sequential`` to cut into stages (default: found automatically).
        balance: explicit layers per stage (skips profiling), e.g. ``[3, 2]``.
        max_stage_memory_bytes: per-stage limit on parameters + gradients + optimizer state.
        optimizer_state_factor: optimizer state bytes per parameter byte used in the memory estimate (Adam: 2).
        profile_repeats: timed repetitions per layer when profiling.
        start_method: ``"popen"`` (re-run the script per process, like Lightning's DDP) or ``"spawn"``.
        process_group_backend: ``"gloo"`` / ``"nccl"`` (default: by device).
        timeout: collective timeout.
        elastic: live reconfiguration (``None``: on when ``PARCAE_ELASTIC=1``, which ``parcae run`` sets). Needs a
            coordination store that outlives the workers (``PARCAE_STORE``); see ``docs/elastic.md``.
        interval_s: elastic only: planning interval (predictor + liveput optimizer) in wall seconds (default: the
            launcher's ``PARCAE_INTERVAL_S``, else 60).
        interval_steps: elastic only: planning interval in optimizer steps (0: wall time only).
        look_ahead: elastic only: intervals the liveput optimizer plans over.
        predictor: elastic only: ``"persistence"``, ``"arima"`` or ``"artifact"``.
        heartbeat_s: elastic only: heartbeat period.
        dead_after_s: elastic only: a member silent this long is declared dead.
        stall_after_s: elastic only: progress watchdog -- an operation that makes no progress this long (while
            heartbeats are fine) fails and becomes a recovery (``PARCAE_STALL_S`` overrides it).
        max_pipeline_stages: elastic only: deepest pipeline the optimizer may choose (default: number of layers).
        throughput: elastic only: how the optimizer prices shapes -- ``"measured"`` (default: shapes the job ran by
            their measured step times, others by a model fitted to them; see ``docs/elastic.md``) or ``"profile"``
            (the per-layer formula only, as before; step times are still recorded into ``profile.json``).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for Lightning's
            strategies (normally filled in by the Trainer).
    """

    strategy_name = "parcae"
    _ns_name = "pytorch_lightning"

    def __init__(
        self,
        pipeline_stages: Optional[int] = None,
        micro_batches: int = 1,
        schedule: Literal["1f1b", "gpipe"] = "1f1b",
        layers_attr: Optional[str] = None,
        balance: Optional[list[int]] = None,
        max_stage_memory_bytes: Optional[int] = None,
        optimizer_state_factor: float = 2.0,
        profile_repeats: int = 2,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = timedelta(minutes=30),
        elastic: Optional[bool] = None,
        interval_s: Optional[float] = None,
        interval_steps: int = 0,
        look_ahead: int = 12,
        predictor: str = "persistence",
        heartbeat_s: float = 0.2,
        dead_after_s: float = 3.0,
        stall_after_s: float = 60.0,
        max_pipeline_stages: Optional[int] = None,
        throughput: Literal["measured", "profile"] = "measured",
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
    ) -> None:
        under = launcher_env.under_launcher()
        if cluster_environment is None and under:
            cluster_environment = launcher_env.environment_class(self._ns_name)()
        if pipeline_stages is None and balance is None and under:
            from_launcher = launcher_env.launcher_pipeline_stages()
            pipeline_stages = from_launcher if isinstance(from_launcher, int) else None
        if interval_s is None:
            interval_s = (launcher_env.launcher_interval_s() if under else None) or 60.0
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if pipeline_stages is not None and pipeline_stages < 1:
            raise ConfigurationError(f"pipeline_stages must be >= 1, got {pipeline_stages}")
        if micro_batches < 1:
            raise ConfigurationError(f"micro_batches must be >= 1, got {micro_batches}")
        if throughput not in ("measured", "profile"):
            raise ConfigurationError(f"throughput must be 'measured' or 'profile', got {throughput!r}")
        if schedule not in ("1f1b", "gpipe"):
            raise ConfigurationError(f"schedule must be '1f1b' or 'gpipe', got {schedule!r}")
        if balance is not None and pipeline_stages is not None and len(balance) != pipeline_stages:
            raise ConfigurationError(
                f"balance={balance} has {len(balance)} stages but pipeline_stages={pipeline_stages}"
            )
        self.pipeline_stages_option = pipeline_stages if balance is None else len(balance)
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.layers_attr = layers_attr
        self.balance = list(balance) if balance is not None else None
        self.max_stage_memory_bytes = max_stage_memory_bytes
        self.optimizer_state_factor = optimizer_state_factor
        self.profile_repeats = profile_repeats
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        # runtime state (rebuildable under a new generation)
        self.groups: Optional[ProcessGroups] = None
        self._store: Optional[dist.Store] = None
        self.stack_path: Optional[str] = None
        self.layer_names: list[str] = []
        self.partition: list[int] = []
        self.layer_times: list[float] = []
        self._stage: Optional[nn.Sequential] = None
        self._proxy: Optional[StageProxy] = None
        self._p2p: Optional[P2P] = None
        # live reconfiguration
        if elastic is None:
            elastic = os.environ.get(ELASTIC_ENV, "0") not in ("", "0", "false")
        self.elastic = bool(elastic)
        self.elastic_options: dict[str, Any] = dict(
            interval_s=interval_s, interval_steps=interval_steps, look_ahead=look_ahead, predictor=predictor,
            heartbeat_s=heartbeat_s, dead_after_s=dead_after_s, stall_after_s=stall_after_s, throughput=throughput,
        )
        self.max_pipeline_stages = max_pipeline_stages
        self.elastic_runtime: Optional[Any] = None
        self._full_stack: Optional[nn.Sequential] = None
        self.checkpoints = StrategyCheckpoints(self)
        self.layout = StageLayout(self)
        self.steps = StepRunner(self)
        self.data = DataPath(self)
        self.profiler = LayerProfiler(self)
        self._no_cut_reason: Optional[str] = None
        self._fit_generation: Optional[int] = None  # last generation of an elastic fit (later stages count on)
        self._post_fit_stages = 0

    # ============================================================================================ Lightning plumbing
    @property
    def is_distributed(self) -> bool:
        """Always distributed: Lightning must treat every process as one rank of the job."""
        return True

    @property
    def _solo(self) -> bool:
        """A joiner before it trains: Lightning's set-up collectives would not be matched by the running members,
        so ``broadcast`` / ``barrier`` / ``reduce`` act locally until it has joined -- and never again after: once
        admitted it is a member like any other, also after ``fit`` (a joiner whose barrier in
        ``trainer.save_checkpoint`` returned at once exited while the others were still in it)."""
        er = self.elastic_runtime
        return er is not None and er.joining and not er.admitted

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """A joiner restores after ``setup`` (its stage exists only then); everyone else restores before."""
        er = self.elastic_runtime
        return er is not None and er.joining

    @property
    def parallel_devices(self) -> Optional[list[torch.device]]:
        """This machine's devices; under ``parcae run`` / ``parcae agent`` one per worker the launcher started here
        (``LOCAL_WORLD_SIZE``) when the script gave no ``devices=`` (a contradicting one is refused)."""
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: Optional[list[torch.device]]) -> None:
        self._parallel_devices = launcher_env.resolve_devices(devices) if devices else devices

    @property
    def root_device(self) -> torch.device:
        """This process's device."""
        devices = self.parallel_devices
        if not devices:
            raise ConfigurationError("ParcaeStrategy has no devices yet: pass it to a Trainer before use")
        rank = self.local_rank
        if rank >= len(devices):
            raise ConfigurationError(
                f"this process has LOCAL_RANK={rank} but the Trainer was given {len(devices)} device(s); start "
                f"{len(devices)} process(es) per machine or give the Trainer devices={rank + 1} or more"
            )
        return devices[rank]

    @property
    def num_nodes(self) -> int:
        """Number of nodes (machines)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def data_parallel(self) -> int:
        """D (valid after ``setup_environment``)."""
        return self.groups.data_parallel if self.groups is not None else 1

    @property
    def pipeline_stages(self) -> int:
        """P (valid after ``setup_environment``)."""
        return self.groups.pipeline_stages if self.groups is not None else 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """All stages of a pipeline read the same shard: replicas = D, rank = pipeline index (used for predict)."""
        if self.groups is None:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": self.groups.data_parallel, "rank": self.groups.coords.replica}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = self._ns.SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                                self.num_nodes)
        else:
            self._launcher = self._ns.MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        """Derive global rank / world size from node rank, local rank and process count.

        Under live reconfiguration the launcher's (or agent's, or torchrun's) ``RANK`` / ``WORLD_SIZE`` are taken
        as given, so a script started with ``devices=1`` on each of N machines needs no ``num_nodes=N``.
        """
        er = self.elastic_runtime
        if er is not None and er.layout is not None and er.member in er.layout.members:
            # a later Trainer stage (validate/test after an elastic fit): the ranks of the fit's last generation,
            # not the launcher's start-up RANK/WORLD_SIZE (a joiner started as RANK=0 of WORLD_SIZE=1)
            self._set_ranks(er.layout.members.index(er.member), len(er.layout.members))
            return
        if self.cluster_environment is not None:
            if self.elastic and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                self.cluster_environment.set_global_rank(int(os.environ["RANK"]))
                self.cluster_environment.set_world_size(int(os.environ["WORLD_SIZE"]))
            else:
                self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
                self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        """Check the Trainer, create the base store and the generation-0 process groups."""
        if self.lightning_module is not None and getattr(self.lightning_module, "_trainer", None) is not None:
            check_trainer(self.lightning_module._trainer, self._ns_name)
            self._install_launcher_resume(self.lightning_module._trainer)
        super().setup_environment()
        if self.elastic_runtime is not None and self.groups is not None and self.groups.built:
            # validate/test/predict after fit: the job runs on the generation fit ended in (its members, ranks and
            # groups); the launch's RANK / WORLD_SIZE and a rebuilt "generation 1" would be stale after any change
            return
        self.set_world_ranks()
        world = self.world_size
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        self._process_group_backend = backend
        if self.elastic and self.elastic_runtime is None:
            from lightning_parcae.runtime.elastic import ElasticRuntime  # noqa: PLC0415

            self.elastic_runtime = ElasticRuntime.from_env(self, **self.elastic_options)
            self._store = self.elastic_runtime.connect()
            self._timeout = min(self._timeout, timedelta(minutes=5))
            if self.elastic_runtime.joining:  # its shape comes from the generation that admits it
                self._timeout = self.elastic_runtime.stall_timeout  # everyone it meets is already running
                self._join_environment(backend)
                return
        p = len(self.partition) if self.partition else (self.pipeline_stages_option or 1)
        if world % p:
            raise ConfigurationError(
                f"pipeline_stages={p} does not divide devices x nodes = {world}; D = devices / P must be whole"
            )
        if self._store is None and world == 1:
            self._store = dist.HashStore()
        elif self._store is None:
            assert self.cluster_environment is not None
            self._store = dist.TCPStore(
                self.cluster_environment.main_address,
                self.cluster_environment.main_port,
                world,
                self.global_rank == 0,
                timeout=self._timeout,
            )
        if self.groups is not None:  # a previous Trainer stage of this strategy left its generation up
            self.groups.destroy()
        elif dist.is_initialized():
            dist.destroy_process_group()
        er = self.elastic_runtime
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
        self.groups = ProcessGroups(generation, self.global_rank, world, world // p, p, self._store, backend,
                                    self._timeout).build()
        if er is not None and not after_fit:
            er.boot_register(generation, self.global_rank)

    def _install_launcher_resume(self, trainer: Any) -> None:
        """Under ``parcae run``: a ``fit`` without ``ckpt_path`` resumes from the launcher's checkpoint
        (``PARCAE_RESUME_CKPT``, set on a fallback relaunch); a ``ckpt_path`` the script gives wins."""
        path = launcher_env.launcher_resume_path() if launcher_env.under_launcher() else None
        if path is None or trainer.state.fn != _FIT:
            return
        connector = trainer._checkpoint_connector
        original = connector.resume_start

        def resume_start(checkpoint_path: Any = None, **kwargs: Any) -> None:
            connector.resume_start = original  # type: ignore[method-assign]
            if checkpoint_path is None:
                log.info("resuming from the launcher's checkpoint %s", path)
            original(checkpoint_path if checkpoint_path is not None else path, **kwargs)

        connector.resume_start = resume_start  # type: ignore[method-assign]

    def _add_launcher_callbacks(self, trainer: Any) -> None:
        """Under ``parcae run``: periodic checkpoints, the agreed stop of the restart fallback and progress/end
        events (:class:`~lightning_parcae.training.callbacks.ParcaeRunCallback`), unless the script added its own."""
        from lightning_parcae.training.callbacks import ParcaeRunCallbackMixin, callback_class  # noqa: PLC0415

        if not os.environ.get(RUN_DIR_ENV) or any(isinstance(cb, ParcaeRunCallbackMixin) for cb in trainer.callbacks):
            return
        trainer.callbacks.append(callback_class("run", self._ns_name)())

    def _join_environment(self, backend: str) -> None:
        """A joiner: wait as a standby until admitted, receive state, build the admitting generation's groups."""
        er = self.elastic_runtime
        assert er is not None
        rec = er.join_wait()
        layout = er.layout
        assert layout is not None
        rank = layout.members.index(er.member)
        self._set_ranks(rank, len(layout.members))
        self.partition = list(layout.partition)
        self.stack_path = rec["stack_path"]
        self.layer_names = list(rec["layer_names"])
        if self.stack_path == "":  # the job trains a model without a cuttable stack: P stays 1
            self.max_pipeline_stages = 1
        self.layer_times = list(rec.get("layer_times") or [])
        self.groups = ProcessGroups(int(rec["generation"]), rank, len(layout.members), layout.data_parallel,
                                    layout.pipeline_stages, self._store, backend, self._timeout).build()

    def _set_ranks(self, rank: int, world: int) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(rank)
            self.cluster_environment.set_world_size(world)
        rank_zero_only.rank = rank

    # ============================================================================================ setup
    def setup(self, trainer: "pl.Trainer") -> None:
        """Partition the model, place this stage, sync replicas, build optimizers over local parameters."""
        check_trainer(trainer, self._ns_name)
        assert self.accelerator is not None and self.groups is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise ConfigurationError("ParcaeStrategy supports automatic optimization only")
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ConfigurationError(
                "16-mixed precision with a GradScaler is not supported by ParcaeStrategy; use precision='bf16-mixed' "
                "or '32-true'"
            )
        self.model = self.precision_plugin.convert_module(module)
        self.data.install(trainer)
        joining = self.elastic_runtime is not None and self.elastic_runtime.joining and self._stage is None
        if joining:
            self._install_live_restore(trainer)
            self._full_stack = self.layout.stack()
            self.layout.build()
        elif self._stage is None:
            self.model_to_device()
            self.layout.partition_module(trainer)
        else:  # a later Trainer stage (validate/test after fit): same partition, new groups
            self._p2p = P2P(self.root_device, self.groups.pipeline_group)
        self.model_to_device()
        if not joining:
            self.layout.sync_replicas()
        self.layout.bind_metrics()
        if trainer.state.fn == _FIT:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == _FIT:
            from lightning_fabric.utilities.optimizer import _optimizers_to_device  # noqa: PLC0415

            _optimizers_to_device(self.optimizers, self.root_device)
        self.precision_plugin.clip_grad_by_norm = self.steps.clip_grad_by_norm  # type: ignore[method-assign]
        if trainer.state.fn == _FIT:
            self._add_launcher_callbacks(trainer)
        if self.elastic_runtime is not None and trainer.state.fn == _FIT:
            if "_after_closure" not in self.precision_plugin.__dict__:
                self.precision_plugin._after_closure = self._after_closure_commit(  # type: ignore[method-assign]
                    self.precision_plugin._after_closure
                )
            self._setup_elastic(trainer, joining)

    # ============================================================================================ live reconfiguration
    def _setup_elastic(self, trainer: "pl.Trainer", joining: bool) -> None:
        """Attach the interval callback; initial members agree on generation 0, a joiner starts heartbeating."""
        from lightning_parcae.training.callbacks import ParcaeElasticCallbackMixin, callback_class  # noqa: PLC0415

        er = self.elastic_runtime
        assert er is not None
        if trainer.accumulate_grad_batches != 1:
            raise ConfigurationError(
                f"live reconfiguration needs accumulate_grad_batches=1 (got {trainer.accumulate_grad_batches}): a "
                "membership change between the micro-steps of one accumulated step cannot be replayed; raise the "
                "DataLoader's batch_size instead"
            )
        if not any(isinstance(cb, ParcaeElasticCallbackMixin) for cb in trainer.callbacks):
            trainer.callbacks.append(callback_class("elastic", self._ns_name)())
        from lightning_parcae.runtime.liveness import activate  # noqa: PLC0415

        # Lightning broadcasts a SIGTERM flag from rank 0 before every batch, outside any guarded wait: a lost or
        # hung rank 0 would block the others there for the group timeout. SIGTERM is a notice here (agreed at
        # the step boundary), so the broadcast has nothing to carry.
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]
        if joining:
            return  # er.joined() runs once the loop state is restored (on_train_start)
        er.boot_publish(trainer)
        activate(er.live)
        # start-up is over: from now on an operation that makes no progress fails within the watchdog's bound
        self._timeout = er.stall_timeout
        if self.groups is not None:
            self.groups.set_op_timeout(self._timeout)

    def _install_live_restore(self, trainer: "pl.Trainer") -> None:
        """A joiner 'resumes' from the state received from live peers, through Lightning's own restore path."""
        from lightning_parcae.runtime.elastic import LIVE_CHECKPOINT  # noqa: PLC0415

        connector = trainer._checkpoint_connector
        original = connector.resume_start

        def resume_start(checkpoint_path: Any = None, **kwargs: Any) -> None:
            original(LIVE_CHECKPOINT, **kwargs)
            connector.resume_start = original  # type: ignore[method-assign]

        connector.resume_start = resume_start  # type: ignore[method-assign]

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """One optimizer step; under live reconfiguration a step interrupted by a lost peer is applied everywhere
        or discarded everywhere (two-phase), then re-run on the recovered shape with the same global batch."""
        er = self.elastic_runtime
        if er is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        from lightning_parcae.errors import PeerLostError  # noqa: PLC0415

        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        step = int(trainer.global_step)
        cursor = (self.data.cursor_epoch, self.data.cursor)
        inner = getattr(optimizer, "_optimizer", optimizer)
        while True:
            self._committing = step
            try:
                return super().optimizer_step(optimizer, closure, model, **kwargs)
            except PeerLostError as exc:
                log.warning("step %d interrupted: %s", step, exc)
                if er.decide_commit(step):
                    inner.step()  # everyone reduced its gradients: apply the step as the others did
                    er.recover(trainer)
                    return None
                for p in (self.lightning_module.parameters() if self.lightning_module is not None else []):
                    p.grad = None
                self.steps.pending_grads = None
                self.data.cursor_epoch, self.data.cursor = cursor
                er.recover(trainer)
                self.data.rerun_step = True
            finally:
                self._committing = None

    def _after_closure_commit(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def after_closure(model: Any, optimizer: Any) -> Any:
            out = original(model, optimizer)
            er = self.elastic_runtime
            if er is not None and getattr(self, "_committing", None) is not None:
                er.commit(int(self._committing))
            return out

        return after_closure

    def model_to_device(self) -> None:
        """Move the (local) module to this process's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    def apply_layout(self, trainer: "pl.Trainer", layout: Any, generation: int, received: Mapping[int, Any],
                     group_of: list[dict[str, int]]) -> None:
        """Rebuild this process's groups, stage, optimizer binding and data slice for ``layout`` (in place)."""
        self.layout.apply(trainer, layout, generation, received, group_of)

    @property
    def whole_model(self) -> bool:
        """True when the model has no cuttable layer stack and trains at P = 1 only."""
        return self.stack_path == ""

    def layer_key(self, name: str) -> str:
        """The state-dict prefix of layer ``name`` (``"<stack_path>.<name>"``)."""
        return f"{self.stack_path}.{name}" if self.stack_path else name

    @property
    def global_batch(self) -> Optional[int]:
        """B, the global batch size, once the training loader is known."""
        return self.data.global_batch

    @property
    def full_stack(self) -> Optional[nn.Sequential]:
        """The whole layer stack (all layers, also those other stages hold), once built."""
        return self._full_stack

    @contextmanager
    def local_state_dump(self) -> Iterator[None]:
        """Within it, ``lightning_module_state_dict`` returns this process's own state (no gather)."""
        self.checkpoints.local_dump = True
        try:
            yield
        finally:
            self.checkpoints.local_dump = False

    def is_stage_key(self, key: str) -> bool:
        """Whether a state-dict / optimizer-state key belongs to a layer of the stack (not a replicated part)."""
        if self.stack_path:
            return key.startswith(self.stack_path + ".")
        return key.split(".", 1)[0] in set(self.layer_names)

    def stage_key_set(self) -> set[str]:
        assert self.stack_path is not None and self._stage is not None
        return {self.layer_key(k) for k in self._stage.state_dict().keys()}

    # ============================================================================================ data
    def data_state(self) -> dict[str, Any]:
        """The sample cursor: epoch, samples of that epoch consumed, global batch size, sampler RNG state."""
        return self.data.state()

    @property
    def last_step_indices(self) -> list[int]:
        """Global sample indices this pipeline trained on in the last step."""
        return self.data.last_step_indices

    # ============================================================================================ steps
    # Lightning calls these on the strategy; the work is in :class:`~lightning_parcae.training.step_runner.StepRunner`.
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One pipeline step over M micro-batches (forward and backward); returns the mean micro-batch loss."""
        return self.steps.training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Pipeline forward of the batch, then the user's ``validation_step`` on every stage with its output."""
        return self.steps.eval_step("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`validation_step` for ``test_step``."""
        return self.steps.eval_step("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`validation_step` for ``predict_step``."""
        return self.steps.eval_step("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    # ============================================================================================ gradients
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """While Lightning accumulates, skip the data-parallel gradient all-reduce."""
        with self.steps.no_sync():
            yield None

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Put back the gradients computed in :meth:`training_step`, then reduce them (unless accumulating)."""
        return self.steps.backward(closure_loss)

    def reduce_gradients(self) -> None:
        """Sum replicated parameters' gradients over the pipeline, then average everything over the D replicas."""
        self.steps.reduce_gradients()

    # ============================================================================================ collectives
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        """Reduce over the replicas (every stage holds a mirror of its pipeline's values, so P copies are folded).

        With ``group=None`` the reduction runs over all ranks; since the P stages of a pipeline hold identical
        (mirrored) values, ``mean`` / ``max`` / ``min`` are unaffected and ``sum`` is divided by P.
        """
        if not isinstance(tensor, Tensor) or self.groups is None or self.groups.world == 1 or self._solo:
            return tensor
        op = _op_name(reduce_op)
        out = tensor.detach().clone()
        if op in ("mean", "sum") and not out.is_floating_point():
            out = out.float()
        torch_op = {"max": ReduceOp.MAX, "min": ReduceOp.MIN}.get(op, ReduceOp.SUM)
        if not self._elastic_guarded(lambda: dist.all_reduce(out, op=torch_op, group=group, async_op=True),
                                     "metric reduction"):
            return tensor  # a peer was lost: this rank's value; the next step boundary recovers
        if op == "mean":
            return out / dist.get_world_size(group)
        if op == "sum" and group is None:
            return out / self.groups.pipeline_stages
        return out

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        """All (or any) over every rank of the job."""
        if self.groups is None or self.groups.world == 1 or self._solo:
            return decision
        t = torch.tensor(int(decision), device=self.root_device)
        if not self._elastic_guarded(lambda: dist.all_reduce(t, op=ReduceOp.SUM, async_op=True),
                                     "decision all-reduce"):
            return decision
        return bool(t.item() == self.groups.world) if all else bool(t.item() > 0)

    def _elastic_guarded(self, post: Callable[[], Any], what: str) -> bool:
        """Run a guarded collective of Lightning's (metric sync, barrier); False if a peer was lost during it.

        Under live reconfiguration a loss outside the optimizer step (in validation, a checkpoint's barrier) must
        not crash the script: the generation is already aborted, the caller goes on with its local value, and the
        next step boundary recovers in place. Without live reconfiguration the error propagates.
        """
        from lightning_parcae.errors import PeerLostError  # noqa: PLC0415

        try:
            guarded(post, what)
        except PeerLostError:
            if self.elastic_runtime is None or self.elastic_runtime.live is None:
                raise
            log.warning("%s abandoned: a peer was lost; recovering at the next step boundary", what)
            return False
        return True

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Barrier over every rank."""
        if not dist.is_initialized() or self._solo:
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            self._elastic_guarded(lambda: dist.barrier(async_op=True), "barrier")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Broadcast a picklable object from global rank ``src``."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or self._solo:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # ============================================================================================ checkpoints
    # Lightning calls these on the strategy; the work is in :class:`~lightning_parcae.training.checkpointing.StrategyCheckpoints`.
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict with global keys (complete on rank 0)."""
        return self.checkpoints.module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name, merged over the stages (complete on rank 0)."""
        return self.checkpoints.optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write the gathered checkpoint from rank 0, atomically (temp file + ``os.replace``)."""
        self.checkpoints.save(checkpoint, filepath, storage_options)

    def wait_for_checkpoint(self) -> None:
        """Block until a background checkpoint write has finished."""
        self.checkpoints.wait()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Read a checkpoint (always ``weights_only=True``) and remember its sample cursor."""
        return self.checkpoints.load(checkpoint_path)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the keys this process holds from a full (any-layout) state dict."""
        self.checkpoints.load_model_state_dict(checkpoint, strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load name-keyed optimizer state (positional state only when it came from the same single stage)."""
        self.checkpoints.load_optimizer_state_dict(checkpoint)

    def layer_state(self, index: int) -> dict[str, Tensor]:
        """All tensors of global layer ``index`` held here (see :meth:`StrategyCheckpoints.layer_state`)."""
        return self.checkpoints.layer_state(index)

    # ============================================================================================ teardown
    def teardown(self) -> None:
        """Undo the data hook. Process groups stay up (like DDP) so ``trainer.save_checkpoint`` works after ``fit``;
        the next ``setup_environment`` replaces them with a new generation."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        self.data.uninstall(trainer)
        self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)
        self.precision_plugin.__dict__.pop("_after_closure", None)
        self.wait_for_checkpoint()
        if self.elastic_runtime is not None:
            from lightning_parcae.runtime.lifecycle import Phase  # noqa: PLC0415

            finished = self.elastic_runtime.life.phase == Phase.TRAINING
            if finished:
                self.elastic_runtime.life.to(Phase.STOPPED)
            self.elastic_runtime.close(finished=finished)
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"parcae"``."""
        strategy_registry.register("parcae", cls, description=_DESCRIPTION, override=True)

    @property
    def _ns(self) -> Any:
        """This class's Lightning namespace (see :mod:`lightning_parcae.training.namespaces`)."""
        return namespace(self._ns_name)

    def __repr__(self) -> str:
        # Lightning puts the repr into its "invalid strategy" error when a Trainer of the other namespace gets
        # this object: say there which import that Trainer needs.
        other = "lightning.pytorch" if self._ns_name == "pytorch_lightning" else "pytorch_lightning"
        return (f"ParcaeStrategy (built for {self._ns_name}; a {other}.Trainer needs {IMPORT_HINT[other]})")


# ------------------------------------------------------------------------------------------------ helpers
_GENERATION = [0]


def _next_generation() -> int:
    """A fresh generation number per Trainer run in this process (the base store may be reused)."""
    _GENERATION[0] += 1
    return _GENERATION[0] - 1


def _op_name(reduce_op: Any) -> str:
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        return "mean" if name == "avg" else name
    for name, op in (("sum", ReduceOp.SUM), ("max", ReduceOp.MAX), ("min", ReduceOp.MIN), ("mean", ReduceOp.AVG)):
        try:
            if reduce_op == op:
                return name
        except TypeError:
            continue
    return "sum"




# ------------------------------------------------------------------------------------------------ namespaces
_CLASSES: dict[str, type] = {}
CLASS_PATH_NAMES = ("lightning_parcae.parcaestrategy", "lightning_parcae.training.strategy.parcaestrategy",
                    "lightning_parcae.lightning.parcaestrategy")
"""The strategy's class paths as registry names (lower case, as Lightning looks names up). Regression: LightningCLI's
``--trainer.strategy lightning_parcae.ParcaeStrategy`` (a bare class path, no ``class_path:``) reaches the Trainer
as a *string* -- jsonargparse takes the ``str`` branch of ``Union[str, Strategy]`` -- and Lightning refused it as
"an invalid strategy name"; each namespace maps them to its own class."""
_DESCRIPTION = "Parcae D x P pipeline/data-parallel strategy with live reconfiguration on spot instances"


def strategy_class(ns_name: str = "pytorch_lightning") -> type:
    """``ParcaeStrategy`` for one Lightning namespace, built over that namespace's ``ParallelStrategy`` and
    registered as ``"parcae"`` in its ``StrategyRegistry`` (built once per namespace).

    Args:
        ns_name: ``"pytorch_lightning"`` or ``"lightning.pytorch"``.
    """
    cls = _CLASSES.get(ns_name)
    if cls is None:
        ns = namespace(ns_name)
        module = "lightning_parcae.training.strategy" if ns_name == "pytorch_lightning" else "lightning_parcae.lightning"
        cls = type("ParcaeStrategy", (ParcaeStrategyMixin, ns.ParallelStrategy),
                   {"__module__": module, "__qualname__": "ParcaeStrategy", "__doc__": ParcaeStrategyMixin.__doc__,
                    "_ns_name": ns_name})
        _CLASSES[ns_name] = cls
        for name in ("parcae", *CLASS_PATH_NAMES):
            ns.StrategyRegistry.register(name, cls, description=_DESCRIPTION, override=True)
    return cls


def register_imported_namespaces() -> None:
    """Register ``"parcae"`` in every Lightning namespace imported so far (the others register on import, see
    :mod:`lightning_parcae.training.autoregister`)."""
    import sys  # noqa: PLC0415

    for name in ("pytorch_lightning", "lightning.pytorch"):
        if name in sys.modules and getattr(sys.modules[name], "Trainer", None) is not None:
            strategy_class(name)


def __getattr__(name: str) -> Any:
    if name == "ParcaeStrategy":  # the pytorch_lightning class (lightning.pytorch: lightning_parcae.lightning)
        return strategy_class("pytorch_lightning")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register_imported_namespaces()
