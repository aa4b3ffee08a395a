"""Where to cut the layer stack: check that a block list can be cut, and time each layer.

Problem: to balance pipeline stages the strategy needs each layer's forward + backward time on a real input, and
for a ``ModuleList`` of blocks it must first know that ``forward`` chains the blocks (block ``i + 1`` gets block
``i``'s output), or cutting it would change the model. Both need one sample input to the stack, taken from the
module's ``example_input_array`` or the training data, with the user's step run under inspection. Rank 0 measures
and every rank receives the result as plain numbers, so all agree on the split.

Parts outside the stack (:meth:`LayerProfiler.classify_outside`): the embedding before the stack belongs to the
first stage and the final norm and head after it to the last (issue 22), so each outside parameter is classified
once, on one training step run with the stack under inspection (blocks without gradients, the stack's output
handed back as a detached leaf): ``pre`` if the stack's input has a gradient path to it, ``post`` if the loss
has one other than through the stack, ``both`` if both (tied input/output embeddings), and *replicated* (kept on
every stage, as before) if the blocks' extra arguments (masks, positions) depend on it, if nothing does (a part
only validation uses: unclassified parts stay where the step can always reach them), or if it is shared with the
stack. A frozen parameter is traced like a trainable one (``requires_grad`` on for the trace). A persistent buffer
takes the class its module's own parameters share, and is replicated otherwise (a mask registered outside any
module with parameters must stay on every stage). The classification is then checked by value: the step is
replayed (block outputs from the first run, no block recomputed) as a middle stage, the last and the first stage
would run it -- with the parts they do not hold replaced by stand-ins (:func:`~lightning_parcae.runtime.stage.
stand_in`) -- and whatever the blocks' arguments, the stack's input (first stage) or the loss (last stage) would
see differently (a mask computed from the embedding's values), or a replay that fails (an in-place update of a
released part), makes the parts involved replicated. The same run times the outside parts (forward and backward
before and after the stack) so that the partitioner counts them on the first and the last layer.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parcae.errors import ModelLayoutError
from lightning_parcae.runtime.data import global_batch_size
from lightning_parcae.runtime.partition import profile_layer_times
from lightning_parcae.runtime.pipeline import StageBoundary, StageProxy, hidden_of
from lightning_parcae.runtime.stage import is_block_list, own_tensor_sites, stand_in, swapped
from lightning_parcae.runtime.torch_internals import put_own_tensor
from lightning_parcae.training.lightning_internals import fit_data_source
from lightning_parcae.training.log_replay import LogRecorder
from lightning_parcae.training.stage_state import StageState

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["LayerProfiler", "ProfilerHost", "BLOCK_VERDICTS", "OutsideParts", "OUTSIDE_CLASSES"]

log = logging.getLogger(__name__)

_FIT = "fit"  # TrainerFn value (both namespaces)

BLOCK_VERDICTS = {
    1: "no sample input to check how forward uses the blocks (give the module an example_input_array or "
       "training data)",
    2: "forward did not loop over the block list exactly once, in order (`for block in self.blocks: x = "
       "block(x, ...)`); indexing it or calling blocks out of order cannot be cut",
    3: "a block's first argument is not the previous block's output (or its first element): code between the "
       "blocks (e.g. `x = x + block(x)`) cannot be cut; move it into the block",
    4: "running the step with the block list under inspection failed",
    5: "forward called a block more than once in one pass (e.g. `x = block(block(x))`, or a loop over the list "
       "run twice): a block that runs at two depths cannot be cut; give each depth its own block in the list, or "
       "train with pipeline_stages=1",
    6: "forward ran only some of the blocks (a loop over a part of the list, `self.blocks[a:b]`, or a `break`): a "
       "pipeline runs every block of the list; loop over all of them (put blocks that do not run in another "
       "attribute), or train with pipeline_stages=1",
    7: "the block list holds the same module at two positions (weights shared between depths): its parameters "
       "cannot live on two stages; give each position its own block, or train with pipeline_stages=1",
}


OUTSIDE_CLASSES = ("replicated", "pre", "post", "both")
"""The classes of a part outside the stack, by code (0: replicated on every stage)."""
_REPLICATED, _PRE, _POST, _BOTH = range(4)


@dataclass(frozen=True)
class OutsideParts:
    """How the parts outside the layer stack are placed (see the module docstring).

    Attributes:
        classes: State-dict key -> ``"pre"`` / ``"post"`` / ``"both"``; a key left out is replicated.
        pre_seconds: Forward + backward time of what runs before the stack (0 when not measured).
        post_seconds: Forward + backward time of what runs after it, up to the loss (0 when not measured).
    """

    classes: dict[str, str]
    pre_seconds: float = 0.0
    post_seconds: float = 0.0


class ProfilerHost(Protocol):
    """What the profiler needs from the strategy: the module, this process's rank, moving a batch to its device."""

    @property
    def lightning_module(self) -> Any: ...

    @property
    def global_rank(self) -> int: ...

    def batch_to_device(self, batch: Any) -> Any: ...


class _BlockWrapper(nn.Module):
    """Stands in for block ``i`` of a block list while the profiler traces the user's loop: not registered as a
    child (so the block's parameters are not counted twice), and every attribute the loop reads from a block
    (``attention_type``, ...) comes from the block itself. Subclasses define ``forward``."""

    def __init__(self, i: int, block: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_i", i)
        object.__setattr__(self, "_b", block)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_b"], name)


class LayerProfiler:
    """Probe and profile the layer stack of one strategy's module (see the module docstring).

    Args:
        state: The stage state (read only: stack path, groups, layer names).
        profile_repeats: Timed repetitions per layer.
        host: The strategy, for the module, the rank and ``batch_to_device``.
        micro_batches: M: the layers are timed on one micro-batch of a single pipeline (``ceil(B / M)`` rows of the
            sample's ``B``), and the times scaled to the whole batch (:meth:`layer_times`).
    """

    def __init__(self, state: StageState, profile_repeats: int, host: ProfilerHost, micro_batches: int = 1) -> None:
        self.state = state
        self.profile_repeats = profile_repeats
        self.host = host
        self.micro_batches = max(1, int(micro_batches))
        self.block_sample: Optional[tuple[Tensor, tuple, dict]] = None  # first block's input, kept by the probe
        self.block_arity: Optional[int] = None  # length of a block's output tuple (0: a tensor), from the probe
        self._probed_arity = 0

    def check_block_list(self, trainer: Any, stack: nn.Module) -> Optional[str]:
        """Check on rank 0, with one sample, that ``forward`` loops the block list as a chain (block ``i + 1`` gets
        block ``i``'s hidden state first), and keep the first block's input for profiling; every rank gets the
        verdict (None: the list can be cut) and the shape of a block's output (:attr:`block_arity`)."""
        code, arity = 0, 0
        if self.host.global_rank == 0:
            code, self.block_sample = self._probe_blocks(trainer, stack)
            arity = self._probed_arity
        if self.state.groups is not None and self.state.groups.world > 1:
            t = torch.tensor([code, arity], dtype=torch.int64)
            dist.broadcast(t, src=0)
            code, arity = (int(v) for v in t.tolist())
        self.block_arity = arity if not code else None
        return BLOCK_VERDICTS.get(code) if code else None

    def _probe_blocks(self, trainer: Any, stack: nn.Module) -> tuple[int, Optional[tuple[Tensor, tuple, dict]]]:
        module = self.host.lightning_module
        assert module is not None and self.state.stack_path is not None
        blocks = list(stack)  # a ModuleList: its blocks in order (a module registered twice listed twice)
        self._probed_arity = 0
        if len({id(b) for b in blocks}) < len(blocks):
            return 7, None
        calls: list[tuple[int, Any, Any, tuple, dict]] = []
        arities: list[int] = []

        class _Trace(_BlockWrapper):
            def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
                out = self._b(x, *args, **kwargs)  # type: ignore[operator]
                calls.append((self._i, x, hidden_of(out), args, kwargs))  # type: ignore[attr-defined]
                arities.append(len(out) if isinstance(out, (tuple, list)) else 0)
                return out

        class _TraceList(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                object.__setattr__(self, "_traces", [_Trace(i, b) for i, b in enumerate(blocks)])

            def __iter__(self) -> Any:
                return iter(self._traces)  # type: ignore[attr-defined]

            def __len__(self) -> int:
                return len(blocks)

            def __getitem__(self, idx: Any) -> Any:
                if isinstance(idx, slice):  # transformers loops `self.layers[: config.num_hidden_layers]`
                    return self._traces[idx]  # type: ignore[attr-defined]
                raise IndexError("indexed")

        with torch.random.fork_rng(), torch.no_grad(), swapped(module, self.state.stack_path, _TraceList()), \
                LogRecorder(module).active():
            try:
                if not self._run_once(trainer, module):
                    return 1, None
            except IndexError:
                return 2, None
            except Exception as err:  # noqa: BLE001
                log.warning("ParcaeStrategy could not run the step to inspect the block list: %s", err)
                return (2 if calls else 4), None
        order = [c[0] for c in calls]
        if order != list(range(len(blocks))):
            if len(set(order)) < len(order):
                return 5, None
            if order == sorted(order):
                return 6, None
            return 2, None
        for prev, cur in zip(calls, calls[1:]):
            if cur[1] is not prev[2]:
                return 3, None
        first = calls[0]
        if not isinstance(first[1], Tensor):
            return 3, None
        self._probed_arity = arities[0]
        return 0, (first[1].detach(), first[3], first[4])

    def classify_outside(self, trainer: Any, stack: nn.Module) -> OutsideParts:
        """Classify the parts outside ``stack`` on rank 0 (see the module docstring); every rank gets the result.

        Returns:
            The classes (replicated parts left out) and the outside parts' measured times.
        """
        module = self.host.lightning_module
        assert module is not None and self.state.stack_path is not None and self.state.groups is not None
        keys = outside_keys(module, self.state.stack_path)
        if not keys:
            return OutsideParts({})
        codes, pre_s, post_s = [_REPLICATED] * len(keys), 0.0, 0.0
        if self.host.global_rank == 0:
            try:
                batch = self._sample_batch(trainer)
                codes, pre_s, post_s = _classify(module, self.state.stack_path, stack, keys,
                                                 lambda: self._step_loss(module, batch))
            except Exception as err:  # noqa: BLE001 -- replicated is always right, only larger
                log.warning("ParcaeStrategy could not classify the parts outside the layer stack (%s: %s); they "
                            "stay on every stage", type(err).__name__, err)
                codes, pre_s, post_s = [_REPLICATED] * len(keys), 0.0, 0.0
        if self.state.groups.world > 1:
            t = torch.tensor([*codes, pre_s, post_s], dtype=torch.float64)
            dist.broadcast(t, src=0)
            values = t.tolist()
            codes, pre_s, post_s = [int(v) for v in values[:-2]], float(values[-2]), float(values[-1])
        classes = {k: OUTSIDE_CLASSES[c] for k, c in zip(keys, codes) if c != _REPLICATED}
        if classes:
            log.info("ParcaeStrategy: outside the layer stack, %d keys ride with the first layer and %d with the "
                     "last; %d stay on every stage", sum(c in ("pre", "both") for c in classes.values()),
                     sum(c in ("post", "both") for c in classes.values()), len(keys) - len(classes))
        return OutsideParts(classes, pre_s, post_s)

    def _step_loss(self, module: Any, batch: Any) -> Optional[Tensor]:
        """The loss of one training step on ``batch`` (the sum of the module's outputs on its
        ``example_input_array`` when there is no batch); None when there is neither."""
        if batch is not None:
            return _loss_tensor(module.training_step(self.host.batch_to_device(batch), 0))
        example = getattr(module, "example_input_array", None)
        if example is None:
            return None
        example = self.host.batch_to_device(example)
        if isinstance(example, (tuple, list)):
            out = module(*example)
        elif isinstance(example, dict):
            out = module(**example)
        else:
            out = module(example)
        floats = [t for t in _tensors_of(out) if t.is_floating_point()]
        return torch.stack([t.float().sum() for t in floats]).sum() if floats else None

    def profile(self, trainer: "pl.Trainer", stack: nn.Sequential) -> list[float]:
        """Per-layer times, measured on global rank 0 and shared with every rank (so all agree on the split)."""
        return self.layer_times(trainer, stack)[0]

    def layer_times(self, trainer: "pl.Trainer", stack: nn.Sequential,
                    saved: Optional[tuple[list[float], int]] = None) -> tuple[list[float], bool]:
        """Per-layer times for the split: the times of the checkpoint this job resumes from (``saved``: the times
        and the global batch they were measured on, :meth:`StageLayout.saved_layer_times`) when global rank 0 has
        them for the same layers and its sample batch has that size -- else measured now. Rank 0 decides and every
        rank receives its times and its choice, so all agree.

        Problem: measuring every layer's forward and backward on a whole batch, a few times over, on one process
        while the others wait took 41 of the 45 s a relaunch of the emulated GPT-1.5B at 1 x 6 spent from its roster
        to its first step (issue 21) -- paid again at every relaunch for layers measured before.

        Returns:
            (times, reused): the times, and whether they are the saved ones (they then already include the parts
            outside the stack, added when they were measured).
        """
        assert self.state.groups is not None
        n = len(self.state.layer_names)
        times: list[Any] = [None]
        reuse = False
        if self.host.global_rank == 0:
            block_sample = self.block_sample if is_block_list(stack) else None
            extra: tuple[tuple, dict] = ((), {})
            if block_sample is not None:
                sample, extra = block_sample[0], (block_sample[1], block_sample[2])
            elif is_block_list(stack):
                sample = None
            else:
                sample = self._sample_stack_input(trainer)
            if saved is not None and sample is not None and len(saved[0]) == n and sample.dim() > 0 \
                    and int(saved[1]) == int(sample.shape[0]):
                times[0], reuse = list(saved[0]), True
            elif sample is None:
                warnings.warn("ParcaeStrategy found no sample input to profile; balancing by parameter count",
                              stacklevel=2)
                times[0] = [float(sum(p.numel() for p in m.parameters()) + 1) for m in stack]
            else:
                was_training = stack.training
                stack.train()
                try:
                    times[0] = self._timed(stack, sample, extra)
                except Exception as err:  # noqa: BLE001 -- the profile is an optimization: never fail the run for it
                    warnings.warn(f"ParcaeStrategy could not time the layers ({type(err).__name__}: {err}); "
                                  "balancing by parameter count", stacklevel=2)
                    times[0] = [float(sum(p.numel() for p in m.parameters()) + 1) for m in stack]
                finally:
                    stack.train(was_training)
        if self.state.groups.world > 1:
            # floats only: a tensor broadcast (nothing from the network is unpickled); the last one is rank 0's choice
            t = torch.tensor((times[0] if times[0] is not None else [0.0] * n) + [1.0 if reuse else 0.0],
                             dtype=torch.float64)
            dist.broadcast(t, src=0)
            values = t.tolist()
            times[0], reuse = values[:-1], values[-1] > 0.5
        return list(times[0]), bool(reuse)

    def _timed(self, stack: nn.Module, sample: Tensor, extra: tuple[tuple, dict]) -> list[float]:
        """Each layer's forward + backward time for the whole batch ``sample``, timed on one micro-batch.

        Problem: timing every layer on the whole global batch, a few passes over, on one process while the others
        wait was 41 s of each first launch of the emulated GPT-1.5B at 1 x 6 (global batch 128, M = 16), and on a
        real accelerator a whole batch through one layer (GPT-1.5B: 128 x 1024 tokens, attention scores of
        ~6.7 GB) need not fit where one micro-batch does. A stage runs micro-batches: the layers are timed on the
        first ``ceil(B / M)`` rows (dim 0 is the batch, as the pipeline splits it; the blocks' extra arguments with
        that first dimension are cut alike) and the times scaled by ``B / rows``. When the cut sample does not run
        (an extra argument whose first dimension is ``B`` by chance), the whole batch is timed as before.
        """
        batch = int(sample.shape[0]) if sample.dim() else 1
        rows = -(-batch // self.micro_batches)
        if rows < batch:
            try:
                args, kwargs = _rows_of(extra[0], batch, rows), _rows_of(extra[1], batch, rows)
                times = profile_layer_times(stack, sample[:rows], repeats=self.profile_repeats, args=args,
                                            kwargs=kwargs)
                return [t * batch / rows for t in times]
            except Exception as err:  # noqa: BLE001 -- the whole batch still times the layers
                log.info("ParcaeStrategy could not time the layers on %d of %d rows (%s: %s); timing the whole batch",
                         rows, batch, type(err).__name__, err)
        return profile_layer_times(stack, sample, repeats=self.profile_repeats, args=extra[0], kwargs=extra[1])

    def _sample_stack_input(self, trainer: "pl.Trainer") -> Optional[Tensor]:
        """The layer stack's input for one batch: from ``example_input_array`` or the training data."""
        module = self.host.lightning_module
        assert module is not None and self.state.stack_path is not None
        proxy = StageProxy(nn.Identity())
        proxy.mode = "capture"
        with torch.random.fork_rng(), torch.no_grad(), swapped(module, self.state.stack_path, proxy), \
                LogRecorder(module).active():
            try:
                if not self._run_once(trainer, module):
                    return None
            except StageBoundary:
                return proxy.captured if isinstance(proxy.captured, Tensor) else None
            except Exception as err:  # the profile is an optimization: never fail the run for it
                log.warning("ParcaeStrategy could not capture a sample input: %s", err)
                return None
        raise ModelLayoutError(
            f"the module's step returned without calling '{self.state.stack_path}'; forward must run the layer stack"
        )

    def _run_once(self, trainer: "pl.Trainer", module: Any) -> bool:
        """Run ``module`` once: on its ``example_input_array`` if it has one, else ``training_step`` on one
        training batch. False if there is neither (no batch to run)."""
        example = getattr(module, "example_input_array", None)
        if example is not None:
            example = self.host.batch_to_device(example)
            if isinstance(example, (tuple, list)):
                module(*example)
            elif isinstance(example, dict):
                module(**example)
            else:
                module(example)
            return True
        batch = self._sample_batch(trainer)
        if batch is None:
            return False
        module.training_step(self.host.batch_to_device(batch), 0)
        return True

    def _sample_batch(self, trainer: "pl.Trainer") -> Any:
        source = fit_data_source(trainer)
        if source is None or trainer.state.fn != _FIT:
            return None
        try:
            loader = source.dataloader()
            b = global_batch_size(loader)
            return loader.collate_fn([loader.dataset[i] for i in range(min(b, len(loader.dataset)))])
        except Exception as err:
            log.warning("ParcaeStrategy could not read a sample batch: %s", err)
            return None


def outside_keys(module: nn.Module, stack_path: str) -> list[str]:
    """The state-dict keys of ``module``'s parameters and persistent buffers outside the stack at ``stack_path``, in
    registration order (the same on every rank)."""
    return [k for k in own_tensor_sites(module) if not k.startswith(stack_path + ".")]


def _tensors_of(obj: Any) -> list[Tensor]:
    """Every tensor in ``obj`` (through tuples, lists and dicts)."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors_of(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors_of(v)]
    return []


def _loss_tensor(result: Any) -> Optional[Tensor]:
    """The loss of a ``training_step`` result (a tensor or a dict with ``"loss"``), else None."""
    if isinstance(result, Tensor):
        return result
    if isinstance(result, Mapping) and isinstance(result.get("loss"), Tensor):
        return result["loss"]
    return None


def _same(a: list[Tensor], b: list[Tensor]) -> bool:
    """Whether two lists of tensors are equal (floating ones to a relative 1e-5)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            return False
        x, y = x.detach(), y.detach()
        if x.is_floating_point() or x.is_complex():
            if not torch.allclose(x, y, rtol=1e-5, atol=1e-7, equal_nan=True):
                return False
        elif not torch.equal(x, y):
            return False
    return True


class _StackTrace:
    """Stands in for the layer stack while the outside parts are classified (see the module docstring).

    Records the stack's input, the tensors among each block's extra arguments and (first run) each block's output;
    hands the stack's output back as a detached leaf. A replay (``replay`` given) returns the first run's block
    outputs without running a block; ``stop`` raises :class:`StageBoundary` at the stack's end, as the first and the
    middle stages stop there.
    """

    def __init__(self, stack: nn.Module, replay: Optional["_StackTrace"], stop: bool,
                 clock: Callable[[], float]) -> None:
        self.blocks: Optional[list[nn.Module]] = list(stack) if is_block_list(stack) else None
        self.stack = stack
        self.replay = replay
        self.stop = stop
        self.clock = clock
        self.inputs: Optional[Any] = None
        self.args: list[Tensor] = []
        self.outs: list[Any] = []
        self.leaf: Optional[Tensor] = None
        self.loss: Optional[Tensor] = None
        self.t_enter = self.t_exit = 0.0
        self.calls = 0

    def stand_in(self) -> nn.Module:
        """The module to put at the stack's path."""
        trace = self
        if self.blocks is None:
            class _Seq(nn.Module):
                def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
                    return trace.call(0, x, args, kwargs, last=True)

            return _Seq()
        n = len(self.blocks)

        class _Entry(_BlockWrapper):
            def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
                return trace.call(self._i, x, args, kwargs, last=self._i == n - 1)  # type: ignore[attr-defined]

        entries = [_Entry(i, b) for i, b in enumerate(self.blocks)]

        class _List(nn.Module):
            def __iter__(self) -> Any:
                return iter(entries)

            def __len__(self) -> int:
                return n

            def __getitem__(self, idx: Any) -> Any:
                if isinstance(idx, slice):
                    return entries[idx]
                raise IndexError("indexed")

        return _List()

    def call(self, i: int, x: Any, args: tuple, kwargs: dict[str, Any], last: bool) -> Any:
        """One block (or the whole nn.Sequential) of the stack."""
        self.calls += 1
        if i == 0:
            self.t_enter = self.clock()
            self.inputs = x
        self.args += _tensors_of((args, kwargs))
        if self.replay is None:
            with torch.no_grad():
                out = (self.blocks[i](x, *args, **kwargs) if self.blocks is not None  # type: ignore[index]
                       else self.stack(x, *args, **kwargs))
            self.outs.append(out)
        else:
            out = self.replay.outs[i]
        if not last:
            return out
        hidden = hidden_of(out) if self.replay is None else self.replay.leaf
        if not isinstance(hidden, Tensor):
            raise ModelLayoutError("the layer stack's output is not a tensor")
        self.leaf = hidden.detach().requires_grad_(hidden.is_floating_point())
        self.t_exit = self.clock()
        if self.stop:
            raise StageBoundary
        if isinstance(out, tuple) and out:
            return (self.leaf, *out[1:])
        if isinstance(out, list) and out:
            return [self.leaf, *out[1:]]
        return self.leaf


def _classify(module: nn.Module, path: str, stack: nn.Module, keys: list[str],
              step_loss: Callable[[], Optional[Tensor]]) -> tuple[list[int], float, float]:
    """Rank 0's classification of the outside ``keys`` (codes into :data:`OUTSIDE_CLASSES`) and the measured
    seconds before and after the stack at ``path`` (see the module docstring); ``step_loss`` runs one step."""
    sites = own_tensor_sites(module)
    on_stack = {id(t) for t in stack.parameters()} | {id(t) for t in stack.buffers()}
    traced: list[Tensor] = []
    index: dict[int, int] = {}
    for k in keys:
        _, kind, _, t = sites[k]
        if kind == "param" and id(t) not in on_stack and t.is_floating_point() and id(t) not in index:
            index[id(t)] = len(traced)
            traced.append(t)
    nothing = ([_REPLICATED] * len(keys), 0.0, 0.0)
    if not traced:
        return nothing
    device = traced[0].device
    cuda = device.type == "cuda"

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def run(trace: _StackTrace) -> None:
        torch.manual_seed(0)  # the same random stream in every run (dropout)
        with swapped(module, path, trace.stand_in()), LogRecorder(module).active():
            try:
                trace.loss = step_loss()
            except StageBoundary:
                pass

    saved = [(b, b.detach().clone()) for b in module.buffers()]  # running statistics: the trace leaves no trace
    frozen = [p for p in traced if not p.requires_grad]
    try:
        with torch.random.fork_rng(devices=[device] if cuda else []):
            try:
                for p in frozen:
                    p.requires_grad_(True)
                first = _StackTrace(stack, None, False, clock)
                t0 = clock()
                run(first)
                t_end = clock()
                depth = len(first.blocks) if first.blocks is not None else 1
                if first.loss is None or first.leaf is None or not isinstance(first.inputs, Tensor) \
                        or first.calls != depth:
                    return nothing

                def reached(outputs: list[Tensor]) -> set[int]:
                    outs = [o for o in outputs if o.requires_grad]
                    if not outs:
                        return set()
                    grads = torch.autograd.grad(outs, traced, grad_outputs=[torch.ones_like(o) for o in outs],
                                                allow_unused=True, retain_graph=True)
                    return {i for i, g in enumerate(grads) if g is not None}

                t1 = clock()
                pre = reached([first.inputs])
                t2 = clock()
                via_args = reached(first.args)
                t3 = clock()
                post = reached([first.loss])
                t4 = clock()
            finally:
                for p in frozen:
                    p.requires_grad_(False)
            pre_s = (first.t_enter - t0) + (t2 - t1)
            post_s = (t_end - first.t_exit) + (t4 - t3)
            param_codes = [_REPLICATED if i in via_args else
                           _BOTH if i in pre and i in post else
                           _PRE if i in pre else _POST if i in post else _REPLICATED
                           for i in range(len(traced))]
            codes: list[int] = []
            for k in keys:
                m, kind, _, t = sites[k]
                if id(t) in on_stack:
                    codes.append(_REPLICATED)
                elif kind == "param":
                    codes.append(param_codes[index[id(t)]] if id(t) in index else _REPLICATED)
                else:  # a persistent buffer: the class its module's own parameters share, else replicated
                    own = {param_codes[index[id(q)]] if id(q) in index else _REPLICATED
                           for q in m.parameters(recurse=False)}
                    codes.append(own.pop() if len(own) == 1 else _REPLICATED)

            def replay(stand: set[int], stop: bool) -> Optional[_StackTrace]:
                """The step as run by a stage that holds none of the parts of the classes ``stand``, those parts
                replaced by stand-ins (``first`` itself when there are none; None when the step fails so)."""
                chosen = {k: sites[k] for k, c in zip(keys, codes) if c in stand}
                if not chosen:
                    return first
                made: dict[int, Tensor] = {}
                trace = _StackTrace(stack, first, stop, clock)
                try:
                    for m, kind, name, t in chosen.values():
                        if id(t) not in made:
                            made[id(t)] = stand_in(t, t.device)
                        put_own_tensor(m, kind, name, made[id(t)])
                    with torch.no_grad():
                        run(trace)
                    return trace
                except Exception as err:  # noqa: BLE001 -- a part a stage cannot do without is replicated
                    log.info("ParcaeStrategy replicates %s: the step fails without them (%s)", sorted(chosen), err)
                    return None
                finally:
                    for m, kind, name, t in chosen.values():
                        put_own_tensor(m, kind, name, t)

            def demote(which: set[int]) -> None:
                for i, c in enumerate(codes):
                    if c in which:
                        codes[i] = _REPLICATED

            def middle_ok(stand: set[int]) -> bool:  # a middle stage: its blocks' arguments
                middle = replay(stand, stop=True)
                return middle is not None and _same(middle.args, first.args)

            if not middle_ok({_PRE, _POST, _BOTH}):  # which side the blocks' arguments need, if only one
                demote({_PRE} if middle_ok({_POST, _BOTH}) else {_POST, _BOTH} if middle_ok({_PRE})
                       else {_PRE, _POST, _BOTH})
            last = replay({_PRE}, stop=False)  # the last stage: its blocks' arguments and the loss
            if last is None or last.loss is None or not _same(last.args, first.args) \
                    or not _same([last.loss], [first.loss]):
                demote({_PRE})
            head = replay({_POST}, stop=True)  # the first stage: the stack's input and the blocks' arguments
            if head is None or not isinstance(head.inputs, Tensor) or not _same(head.args, first.args) \
                    or not _same([head.inputs], [first.inputs]):
                demote({_POST})
            return codes, max(pre_s, 0.0), max(post_s, 0.0)
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _rows_of(value: Any, batch: int, rows: int) -> Any:
    """``value`` (a block's extra arguments: tensors, tuples, lists, dicts of them) with every tensor whose first
    dimension is ``batch`` cut to its first ``rows``; anything else as it is."""
    if isinstance(value, Tensor):
        return value[:rows] if value.dim() and int(value.shape[0]) == batch else value
    if type(value) is tuple:  # noqa: E721 -- a named tuple or a model output class is left whole
        return tuple(_rows_of(v, batch, rows) for v in value)
    if type(value) is list:  # noqa: E721
        return [_rows_of(v, batch, rows) for v in value]
    if type(value) is dict:  # noqa: E721
        return {k: _rows_of(v, batch, rows) for k, v in value.items()}
    return value
