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
4. The last stage sends the other stages only what is small -- its ``self.log`` calls (those of the M micro-steps
   merged into one per name, mean / sum / max / min as ``reduce_fx`` says; a logged torchmetrics object as its
   state), the returned loss and the rest of the returned dict -- never its outputs; every stage replays the same
   calls, so ``self.log``, torchmetrics and the returned loss are identical on every rank.
5. Lightning's ``zero_grad`` runs between ``training_step`` and ``backward``, so the step's gradients are kept
   aside and put back in :meth:`ParcaeStrategy.backward`, which then averages every stage's gradients over the D
   replicas of that stage (skipped while Lightning accumulates). Clipping uses the norm over *all* stages. Only
   then does the optimizer step (two-phase: no stage updates before every stage has its reduced gradients).

The class itself is thin: Lightning calls its hooks by name and each forwards to one part. The parts get narrow
typed collaborators (the options they read, the :class:`~lightning_parcae.training.stage_state.StageState`, each
other, and a small ``Protocol`` of what they need from the strategy), never the strategy's private fields. The
stage state -- groups, stack path, layer names, partition, layer times, stage module, proxy, transport -- is owned
by the layout; the strategy exposes it read-only (``groups``, ``partition``, ``full_stack``, ... which Lightning's
callers and the runtime's :class:`~lightning_parcae.runtime.host.TrainingHost` read). Lightning's own internals
are reached only through :mod:`lightning_parcae.training.lightning_internals`. The parts:
:class:`~lightning_parcae.training.options.StrategyOptions` (the checked options),
:class:`~lightning_parcae.training.process_setup.ProcessSetup` (ranks, store, process groups),
:class:`~lightning_parcae.training.layout.StageLayout`, :class:`~lightning_parcae.training.data_path.DataPath`,
:class:`~lightning_parcae.training.step_runner.StepRunner`, :class:`~lightning_parcae.training.collectives.Collectives`,
:class:`~lightning_parcae.training.checkpointing.StrategyCheckpoints`,
:class:`~lightning_parcae.training.elastic_hooks.ElasticHooks` and
:class:`~lightning_parcae.training.profiling.LayerProfiler`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed import ReduceOp
from torch.optim import Optimizer

from lightning_parcae.planning.measured import DEFAULT_MAX_EXPLORATION_SHARE
from lightning_parcae.planning.policy import DEFAULT_RISK
from lightning_parcae.planning.shape_optimizer import DEFAULT_MIN_GAIN
from lightning_parcae.runtime.groups import ProcessGroups
from lightning_parcae.training import environment as launcher_env
from lightning_parcae.training.checkpointing import StrategyCheckpoints
from lightning_parcae.training.collectives import Collectives
from lightning_parcae.training.data_path import DataPath
from lightning_parcae.training.elastic_hooks import ElasticHooks
from lightning_parcae.training.layout import StageLayout
from lightning_parcae.training.lightning_internals import module_trainer, optimizers_to_device, unwrap_after_closure
from lightning_parcae.training import lightning_internals
from lightning_parcae.training.namespaces import IMPORT_HINT, check_trainer, namespace
from lightning_parcae.training.options import StrategyOptions
from lightning_parcae.training.process_setup import ProcessSetup
from lightning_parcae.training.profiling import LayerProfiler
from lightning_parcae.training.stage_state import StageState
from lightning_parcae.training.step_runner import StepRunner

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["ParcaeStrategy", "ParcaeStrategyMixin", "strategy_class", "check_trainer"]

_FIT = "fit"  # TrainerFn value (both namespaces)


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
        max_exploration_share: elastic only: the largest share of training wall time spent trying unmeasured
            shapes (a try's migrations and its trial there), in ``[0, 1]``; default 0.1. A try is refused while
            the share so far, the try included at its expected cost, would exceed it (``explore_refused`` event;
            the first try is always allowed); 0 never explores, 1 is no cap. See ``docs/elastic.md``.
        policy: elastic only: how the leader chooses each interval's shape -- ``"liveput"`` (default: Parcae's plan
            over the forecast look-ahead, pricing every migration by what this job's migrations have cost) or
            ``"reactive"`` (the baseline Parcae is measured against: the throughput-best shape for each interval's
            count, no plan and no forecast, reached by the same live migrations -- ``parcae simulate``'s
            ``live-reactive``).
        preemption_notice: elastic only: departures come with a notice (spot instances: AWS two minutes, GCP
            30 s; ``parcae run`` replays every drop as one), so the leaver hands its state over and the optimizer
            prices a stage that loses every replica as a copy, not a checkpoint restart (default True). Set False
            where instances vanish without one: a D=1 shape then prices every departure as a restart.
        prior_profile: elastic only: path or fsspec URL (``s3://...``) of the ``profile.json`` an earlier run of
            this job -- or one on the same instance type and network -- wrote in its run directory. The leader
            prices its first migrations by the migration costs that run measured (and starts from its step times
            when the global batch, micro-batches and per-layer state match) instead of loopback constants, which
            price a first move of gigabyte stages at milliseconds; it refits them from this job's own migrations.
            Read and checked when the strategy is built. See ``docs/elastic.md``.
        risk: elastic only, ``policy="liveput"``: how sure the forecast must be before the leader departs from the
            reactive shape -- the standard deviations of expected gain, over the forecast's scenarios, a departure
            (holding a shape through a dip, a detour) must clear (default 1 -- 0.5 until stop 51; 0 follows the
            expectation; larger departs less often and converges on ``"reactive"``). See ``docs/planner.md``.
        min_gain: elastic only, ``policy="liveput"``: the least fraction of the reactive plan's expected value a
            departure must gain besides clearing the risk rule (default 0.01; 0: any gain that clears it). Where every
            forecast path agrees the spread is 0 and any positive gain would clear the risk rule, yet the prices
            are estimates. See ``docs/planner.md``.
        charge_unmeasured: elastic only, ``policy="liveput"``: a departure whose plan runs shapes not yet measured
            must also clear one sigma of the fitted model's error there, for as long as a wrong fit can cost
            (default True; False: the forecast's spread only). See ``docs/elastic.md``.
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
        max_exploration_share: float = DEFAULT_MAX_EXPLORATION_SHARE,
        preemption_notice: bool = True,
        policy: Literal["liveput", "reactive"] = "liveput",
        prior_profile: Optional[str] = None,
        risk: float = DEFAULT_RISK,
        min_gain: float = DEFAULT_MIN_GAIN,
        charge_unmeasured: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
    ) -> None:
        given = {name: value for name, value in locals().items() if name in StrategyOptions.names()}  # by name
        if cluster_environment is None and launcher_env.under_launcher():
            cluster_environment = launcher_env.environment_class(self._ns_name)()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.options = o = StrategyOptions.resolve(**given)
        # the options the parts read (the runtime's TrainingHost protocol names several of them)
        self.pipeline_stages_option, self.micro_batches, self.schedule = o.pipeline_stages, o.micro_batches, o.schedule
        self.layers_attr, self.balance, self.profile_repeats = o.layers_attr, o.balance, o.profile_repeats
        self.max_stage_memory_bytes, self.optimizer_state_factor = o.max_stage_memory_bytes, o.optimizer_state_factor
        self.elastic = o.elastic
        self.elastic_options = o.elastic_options
        self._num_nodes = 1
        self.elastic_runtime: Optional[Any] = None
        # this process's stage (rebuildable under a new generation): owned and written by the layout only
        self.stage_state = StageState()
        # the parts (each does one job; see docs/design.md), each given only what it uses
        ns_name = self._ns_name
        self.profiler = LayerProfiler(self.stage_state, o.profile_repeats, self, o.micro_batches)
        self.layout = StageLayout(self.stage_state, o, self, self.profiler,
                                  resumed_layout=lambda: self.checkpoints.resumed_layout)
        self.process = ProcessSetup(self, o, self.layout, ns_name)
        # a batch the data path rebuilds goes where Lightning's loop sends one: the precision's dtype (64-true:
        # double; regression -- a window replayed after a loss fed float32 rows to a float64 model), then the device
        self.data = DataPath(self.stage_state, o.micro_batches, o.elastic,
                             lambda batch: self.batch_to_device(self.precision_plugin.convert_input(batch)))
        self.steps = StepRunner(self.stage_state, o.micro_batches, o.schedule, self, self.data)
        self.collectives = Collectives(self.stage_state, self)
        self.elastic_hooks = ElasticHooks(self, self.data, self.steps, self.process, ns_name)
        self.checkpoints = StrategyCheckpoints(self.stage_state, o.micro_batches, self, self.data,
                                               checkpoint_dir=launcher_env.launcher_checkpoint_dir(),
                                               member=launcher_env.launcher_member())

    # ============================================================================================ the stage (read-only)
    # The layout owns these facts (see :class:`~lightning_parcae.training.stage_state.StageState`); the runtime reads
    # them through its TrainingHost protocol.
    @property
    def groups(self) -> Optional[ProcessGroups]:
        """This generation's process groups (``None`` before ``setup_environment``)."""
        return self.stage_state.groups

    @property
    def stack_path(self) -> Optional[str]:
        """Dotted path of the layer stack in the module (``""``: no cuttable stack, P = 1; ``None``: not yet)."""
        return self.stage_state.stack_path

    @property
    def layer_names(self) -> list[str]:
        """Child names of the whole layer stack, in order."""
        return self.stage_state.layer_names

    @property
    def partition(self) -> list[int]:
        """Layers per stage of the current layout."""
        return self.stage_state.partition

    @property
    def layer_times(self) -> list[float]:
        """Measured forward + backward time per layer (may be empty)."""
        return self.stage_state.layer_times

    @property
    def max_pipeline_stages(self) -> Optional[int]:
        """Deepest pipeline live reconfiguration may choose: 1 for a model without a cuttable stack or under manual
        optimization, else the option (``None``: as many as layers)."""
        module = self.lightning_module
        if self.stage_state.whole_model or (module is not None and not module.automatic_optimization):
            return 1  # (manual optimization runs at P = 1 only)
        return self.options.max_pipeline_stages

    # ============================================================================================ Lightning plumbing
    @property
    def is_distributed(self) -> bool:
        """Always distributed: Lightning must treat every process as one rank of the job."""
        return True

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
        """This process's device (refused with a clear error when ``LOCAL_RANK`` has none)."""
        return self.process.device()

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
        return self.data.sampler_kwargs()

    def _configure_launcher(self) -> None:
        self._launcher = self.process.lightning_launcher()

    def set_world_ranks(self) -> None:
        """Derive global rank / world size (see :meth:`ProcessSetup.set_world_ranks`)."""
        self.process.set_world_ranks()

    def setup_environment(self) -> None:
        """Check the Trainer, create the base store and the generation-0 process groups."""
        self.process.before_environment()
        super().setup_environment()
        self.process.setup_environment()

    # ============================================================================================ setup
    def setup(self, trainer: "pl.Trainer") -> None:
        """Partition the model, place this stage, sync replicas, build optimizers over local parameters."""
        check_trainer(trainer, self._ns_name)
        assert self.accelerator is not None and self.groups is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        self.steps.check_supported(module)
        self.model = self.precision_plugin.convert_module(module)
        self.data.install(trainer)
        joining = self.elastic_runtime is not None and self.elastic_runtime.joining and self.stage_state.stage is None
        if joining:
            self.elastic_hooks.install_live_restore(trainer)
        self.layout.place(trainer, joining)
        if trainer.state.fn == _FIT:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == _FIT:
            optimizers_to_device(self.optimizers, self.root_device)
        self.precision_plugin.clip_grad_by_norm = self.steps.clip_grad_by_norm  # type: ignore[method-assign]
        if trainer.state.fn == _FIT:
            self.process.add_launcher_callbacks(trainer)
        if self.elastic_runtime is not None and trainer.state.fn == _FIT:
            self.elastic_hooks.setup(trainer, joining)
        elif trainer.state.fn == _FIT and launcher_env.launcher_restarts():
            # the launcher's restart fallback: a first launch whose D cannot split the batch stops to be relaunched
            # with one (under an elastic launcher a script that turned live reconfiguration off keeps the error)
            from lightning_parcae.training.callbacks import ParcaeRunCallbackMixin  # noqa: PLC0415

            run = next((cb for cb in trainer.callbacks if isinstance(cb, ParcaeRunCallbackMixin) and cb.active), None)
            self.data.before_split = run.stop_if_batch_misfits if run is not None else None

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """One optimizer step; under live reconfiguration a step interrupted by a lost peer is applied everywhere
        or discarded everywhere (two-phase), then re-run on the recovered shape with the same global batch."""
        step = partial(super().optimizer_step, optimizer, closure, model, **kwargs)
        if self.elastic_runtime is not None:
            return self.elastic_hooks.optimizer_step(optimizer, step)
        out = step()
        self.data.close_window()
        return out

    def model_to_device(self) -> None:
        """Move the (local) module to this process's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    def apply_layout(self, trainer: "pl.Trainer", layout: Any, generation: int, received: Mapping[int, Any],
                     group_of: list[dict[str, int]]) -> None:
        """Rebuild this process's groups, stage, optimizer binding and data slice for ``layout`` (in place): the
        process setup makes this process its rank and builds the generation's groups, the layout installs them with
        the received layers, the data path reslices the batches to come."""
        assert self.elastic_runtime is not None and self.stage_state.full_stack is not None
        rank = layout.members.index(self.elastic_runtime.member)
        world, d, p = len(layout.members), layout.data_parallel, layout.pipeline_stages
        self.process.set_ranks(rank, world)
        groups = self.process.build_groups(generation, rank, world, d, p)
        self.layout.apply(list(layout.partition), groups, received, group_of)
        self.data.reshard(d, groups.coords.replica)

    @property
    def whole_model(self) -> bool:
        """True when the model has no cuttable layer stack and trains at P = 1 only."""
        return self.stage_state.whole_model

    def layer_key(self, name: str) -> str:
        """The state-dict prefix of layer ``name`` (``"<stack_path>.<name>"``)."""
        return self.stage_state.layer_key(name)

    @property
    def global_batch(self) -> Optional[int]:
        """B, the global batch size, once the training loader is known."""
        return self.data.global_batch

    @property
    def full_stack(self) -> Optional[nn.Module]:
        """The whole layer stack (all layers, also those other stages hold), once built."""
        return self.stage_state.full_stack

    def local_state_dump(self) -> AbstractContextManager[None]:
        """Within it, ``lightning_module_state_dict`` returns this process's own state (no gather)."""
        return self.checkpoints.local_state_dump()

    def is_stage_key(self, key: str) -> bool:
        """Whether a state-dict / optimizer-state key belongs to a layer of the stack (not a replicated part)."""
        return self.layout.is_stage_key(key)

    def stage_key_set(self) -> set[str]:
        """The state-dict keys (global names) of the layers this process holds."""
        return self.layout.stage_key_set()

    @property
    def outside_parts(self) -> dict[str, str]:
        """The parts outside the layer stack that belong to a stage: state-dict key -> ``"pre"`` / ``"post"`` /
        ``"both"`` (recorded in each generation, so a joiner adopts them)."""
        return dict(self.stage_state.outside)

    def outside_keys_of(self, index: int) -> list[str]:
        """The outside keys that ride with layer ``index`` in a migration (layer 0: the embedding; the last: the
        head)."""
        return self.stage_state.outside_keys_of(index)

    # --- TrainingHost: what the runtime asks of Lightning (runtime/host.py; owned by the runtime's helper) ---
    def torch_optimizers(self) -> list[Optimizer]:
        """The torch optimizers inside Lightning's ``LightningOptimizer`` wrappers, in the order of ``optimizers``."""
        return [lightning_internals.inner_optimizer(o) for o in self.optimizers]

    def validation_follows(self, trainer: "pl.Trainer") -> bool:
        """Whether Lightning runs a validation right after the step that just ended.

        Regression (held-out chaos seed 1102): a standby admitted at step 21, a validation step, restored the loop
        state of the end of that step -- where Lightning treats the pending validation as done -- and went on
        training while the members validated: mismatched collectives, a 15 s stall until the watchdog. Planned
        admissions wait one step when this is true.
        """
        return lightning_internals.validation_follows(trainer)

    def training_ends(self, trainer: "pl.Trainer") -> bool:
        """Whether the step that just ended is the last one ``fit`` trains (``max_steps`` or the last epoch's end).

        Regression (chaos seed 49, under load): a standby admitted at step 22 of ``max_steps=22`` restored a loop
        that was already done, so its ``fit`` ended without the end-of-fit collectives the member still ran; the
        member's guard gave up on them ("recovering at the next step boundary" -- there is none), and the code after
        ``fit`` ran one collective apart: ``save_checkpoint``'s barrier failed, exit 1. Nobody is admitted (and
        no interval plan is made) at the last step: no step would use the new shape.
        """
        return training_ends(trainer)

    def epoch_ends(self, trainer: "pl.Trainer") -> bool:
        """Whether the step that just ended is the last of its epoch.

        Regression (issue 23, gradient accumulation 4 made it 4x likelier): a standby admitted at the last step of
        an epoch restored the loop there and ran the epoch-end hooks right away -- but with the state of a process
        that has not loaded the validation loader yet: ModelCheckpoint(monitor=...) decides whether to save at a
        training epoch's end from ``trainer.num_val_batches`` (0 in the joiner, so it saved: a barrier and a
        reduction the members, which had validated, did not make). The members stalled 60 s in their next
        gradient all-reduce. Planned admissions wait one step when this is true.
        """
        return epoch_ends(trainer)

    def loop_checkpoint(self, trainer: "pl.Trainer") -> dict[str, Any]:
        """Lightning's checkpoint of this process's own state: loops, callbacks, schedulers (no gather)."""
        with self.local_state_dump():
            return lightning_internals.checkpoint_connector(trainer).dump_checkpoint(weights_only=False)

    def reset_eval_loaders(self, trainer: "pl.Trainer") -> None:
        """Make Lightning rebuild the validation loader (and its distributed sampler) at the next validation.

        Regression: the loader was built once, sharded for the D of the first validation; after a change of D the
        stages of one pipeline read different validation batches and the last stage's output (16 sequences) no
        longer matched its own targets (8) -- "Expected input batch_size (1024) to match target batch_size (512)".
        """
        lightning_internals.forget_val_loader(trainer)

    def save_before_leaving(self, trainer: "pl.Trainer", path: str) -> None:
        """Collective: save the whole job's checkpoint to ``path`` -- or, with the launcher's checkpoint directory, as
        a new checkpoint there -- and wait until the write has finished."""
        store = self.checkpoints.store
        trainer.save_checkpoint(store.url if store is not None else path)
        self.wait_for_checkpoint()
    # --- end TrainingHost ---

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
        """One pipeline step over M micro-batches (forward and backward); returns the mean micro-batch loss.
        Under live reconfiguration a micro-step of an accumulation window interrupted by a lost peer is replayed
        with its whole window (:meth:`~lightning_parcae.training.elastic_hooks.ElasticHooks.training_step`)."""
        if self.elastic_runtime is None:
            return self.steps.training_step(*args, **kwargs)
        return self.elastic_hooks.training_step(args, kwargs, partial(self.steps.training_step, *args, **kwargs))

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
        """Put back the gradients computed in :meth:`training_step`, then reduce them (unless accumulating); under
        manual optimization the real backward, then the reduction."""
        if self.elastic_runtime is not None and self.lightning_module is not None \
                and not self.lightning_module.automatic_optimization:
            self.elastic_hooks.before_manual_backward()
        return self.steps.backward(closure_loss, optimizer, *args, **kwargs)

    def reduce_gradients(self) -> None:
        """Sum replicated parameters' gradients over the pipeline, then average everything over the D replicas."""
        self.steps.reduce_gradients()

    # ============================================================================================ collectives
    # Lightning calls these on the strategy; the work is in :class:`~lightning_parcae.training.collectives.Collectives`.
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        """Reduce over the replicas, folding the P mirrored copies (see :meth:`Collectives.reduce`)."""
        return self.collectives.reduce(tensor, group, reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        """All (or any) over every rank of the job."""
        return self.collectives.reduce_boolean_decision(decision, all)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Barrier over every rank."""
        self.collectives.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Broadcast a picklable object from global rank ``src``."""
        return self.collectives.broadcast(obj, src)

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
        self.data.uninstall(module_trainer(self.lightning_module))
        self.precision_plugin.__dict__.pop("clip_grad_by_norm", None)
        unwrap_after_closure(self.precision_plugin)
        self.wait_for_checkpoint()
        if self.elastic_runtime is not None:
            self.elastic_hooks.close()
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"parcae"``."""
        strategy_registry.register("parcae", cls, description=_DESCRIPTION, override=True)

    def __repr__(self) -> str:
        # Lightning puts the repr into its "invalid strategy" error when a Trainer of the other namespace gets
        # this object: say there which import that Trainer needs.
        other = "lightning.pytorch" if self._ns_name == "pytorch_lightning" else "pytorch_lightning"
        return (f"ParcaeStrategy (built for {self._ns_name}; a {other}.Trainer needs {IMPORT_HINT[other]})")


# --- TrainingHost: what the runtime asks of Lightning (the loop's end, read through Lightning's public loop state) ---
def training_ends(trainer: "pl.Trainer") -> bool:
    """Whether the step that just ended is the last one ``fit`` trains (see ``ParcaeStrategy.training_ends``)."""
    max_steps = getattr(trainer, "max_steps", -1)
    if max_steps is not None and max_steps >= 0 and int(trainer.global_step) >= max_steps:
        return True
    try:
        loop = trainer.fit_loop
        max_epochs = loop.max_epochs
        last_epoch = max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs
        return bool(last_epoch and loop.epoch_loop.batch_progress.is_last_batch)
    except Exception:  # noqa: BLE001 -- Lightning internals: when in doubt, do not hold admissions back
        return False


def epoch_ends(trainer: "pl.Trainer") -> bool:
    """Whether the step that just ended is the last of its epoch (see ``ParcaeStrategy.epoch_ends``)."""
    try:
        return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
    except Exception:  # noqa: BLE001 -- Lightning internals: when in doubt, do not hold admissions back
        return False
# --- end TrainingHost ---


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
