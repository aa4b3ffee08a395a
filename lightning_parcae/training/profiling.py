"""Where to cut the layer stack: check that a block list can be cut, and time each layer.

Problem: to balance pipeline stages the strategy needs each layer's forward + backward time on a real input, and
for a ``ModuleList`` of blocks it must first know that ``forward`` chains the blocks (block ``i + 1`` gets block
``i``'s output), or cutting it would change the model. Both need one sample input to the stack, taken from the
module's ``example_input_array`` or the training data, with the user's step run under inspection. Rank 0 measures
and every rank receives the result as plain numbers, so all agree on the split.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parcae.errors import ModelLayoutError
from lightning_parcae.runtime.data import global_batch_size
from lightning_parcae.runtime.partition import profile_layer_times
from lightning_parcae.runtime.pipeline import StageBoundary, StageProxy, hidden_of
from lightning_parcae.runtime.stage import is_block_list, swapped
from lightning_parcae.training.lightning_internals import fit_data_source
from lightning_parcae.training.log_replay import LogRecorder
from lightning_parcae.training.stage_state import StageState

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["LayerProfiler", "ProfilerHost", "BLOCK_VERDICTS"]

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


class ProfilerHost(Protocol):
    """What the profiler needs from the strategy: the module, this process's rank, moving a batch to its device."""

    @property
    def lightning_module(self) -> Any: ...

    @property
    def global_rank(self) -> int: ...

    def batch_to_device(self, batch: Any) -> Any: ...


class LayerProfiler:
    """Probe and profile the layer stack of one strategy's module (see the module docstring).

    Args:
        state: The stage state (read only: stack path, groups, layer names).
        profile_repeats: Timed repetitions per layer.
        host: The strategy, for the module, the rank and ``batch_to_device``.
    """

    def __init__(self, state: StageState, profile_repeats: int, host: ProfilerHost) -> None:
        self.state = state
        self.profile_repeats = profile_repeats
        self.host = host
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

        class _Trace(nn.Module):
            def __init__(self, i: int, block: nn.Module) -> None:
                super().__init__()
                object.__setattr__(self, "_i", i)
                object.__setattr__(self, "_b", block)

            def __getattr__(self, name: str) -> Any:  # what the loop reads from a block (attention_type)
                try:
                    return super().__getattr__(name)
                except AttributeError:
                    return getattr(self.__dict__["_b"], name)

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

    def profile(self, trainer: "pl.Trainer", stack: nn.Sequential) -> list[float]:
        """Per-layer times, measured on global rank 0 and shared with every rank (so all agree on the split)."""
        assert self.state.groups is not None
        times: list[Any] = [None]
        if self.host.global_rank == 0:
            block_sample = self.block_sample if is_block_list(stack) else None
            extra: tuple[tuple, dict] = ((), {})
            if block_sample is not None:
                sample, extra = block_sample[0], (block_sample[1], block_sample[2])
            elif is_block_list(stack):
                sample = None
            else:
                sample = self._sample_stack_input(trainer)
            if sample is None:
                warnings.warn("ParcaeStrategy found no sample input to profile; balancing by parameter count",
                              stacklevel=2)
                times[0] = [float(sum(p.numel() for p in m.parameters()) + 1) for m in stack]
            else:
                was_training = stack.training
                stack.train()
                try:
                    times[0] = profile_layer_times(stack, sample, repeats=self.profile_repeats, args=extra[0],
                                                   kwargs=extra[1])
                except Exception as err:  # noqa: BLE001 -- the profile is an optimization: never fail the run for it
                    warnings.warn(f"ParcaeStrategy could not time the layers ({type(err).__name__}: {err}); "
                                  "balancing by parameter count", stacklevel=2)
                    times[0] = [float(sum(p.numel() for p in m.parameters()) + 1) for m in stack]
                finally:
                    stack.train(was_training)
        if self.state.groups.world > 1:
            # floats only: a tensor broadcast (nothing from the network is unpickled)
            n = len(self.state.layer_names)
            t = torch.tensor(times[0] if times[0] is not None else [0.0] * n, dtype=torch.float64)
            dist.broadcast(t, src=0)
            times[0] = t.tolist()
        return list(times[0])

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
