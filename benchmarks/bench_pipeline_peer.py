"""ParcaeStrategy's pipeline engine against ``torch.distributed.pipelining`` on the same GPT-style model.

Problem (issue 22): a pipeline engine is only worth using if it is as fast and as lean as the one that ships with
PyTorch. This script trains one GPT-style language model -- token + position embedding, ``--blocks`` pre-LayerNorm
transformer blocks (``examples/gpt/gpt.py``'s ``Block``), a final LayerNorm and a ``d x vocab`` head, as one
``nn.Sequential`` of ``blocks + 3`` layers; vocabulary 16,384 by default -- on CPU (gloo, one thread per process,
every configuration in its own set of processes started the way torchrun would) under:

- **one process**: a plain PyTorch loop over the whole model, the full batch at once (the reference);
- **ParcaeStrategy** at D=1 x P (P = 2 and 4), schedules ``gpipe`` and ``1f1b``, inside ``pl.Trainer``;
- **torch.distributed.pipelining** (``PipelineStage`` built by hand on each rank, ``ScheduleGPipe`` /
  ``Schedule1F1B``) at the same P, M, micro-batch size and schedule, on **the same stage split** (layers per stage
  are chosen once, before any run, from a profile of the layers on one micro-batch with the project's own
  min-max partitioner; both engines get that split), the same initial parameters, the same loss (mean
  cross-entropy per micro-batch, gradients averaged over the M micro-batches) and the same optimizer step (SGD,
  lr 0.01, one step per iteration on every stage).

and prints samples/s and peak memory per stage side by side with the ratios Parcae / peer::

    python benchmarks/bench_pipeline_peer.py                  # 4-5 minutes on 2 shared cores (280 s at load 2.5-4.8)
    python benchmarks/bench_pipeline_peer.py --dim 256 --blocks 12 --batch 32 --steps 10 --repeats 2
    python benchmarks/bench_pipeline_peer.py --stages 2 --micro-batches 4 --engines peer
    python benchmarks/bench_pipeline_peer.py --vocab 256 --dim 32 --heads 2 --seq 16 --device-ms-per-sample 8 --steps 4

The last form gives every block an **emulated kernel time** (``--device-ms-per-sample``: a sleep per sample, twice
as long in backward, :mod:`lightning_parcae.testing.emulated_device`) on a small real model: a sleeping stage needs
no core, the split balances, and the bubble ratio shows what the engines' schedules and transfers cost, apart from
this machine's cores (8 minutes on 2 cores).

Measures, precisely:

- **samples/s**: rank 0 (the first stage) times the optimizer steps after ``--warmup`` untimed ones, from the start
  of the first timed step to the end of the last one's optimizer step (for Parcae: Lightning's
  ``on_train_batch_start`` / ``on_train_batch_end``, :class:`bench_strategy._Timer`); samples/s = global batch x
  timed steps / that time. With ``--repeats N`` every configuration runs N times, interleaved, and the best is kept.
- **peak memory per stage**: the peak of the process's *anonymous* resident memory over the timed steps, above its
  anonymous RSS after its imports and before the model was built. The high-water mark ``VmHWM`` of
  ``/proc/self/status`` is reset with ``/proc/self/clear_refs`` (``5``) at the first timed step, so set-up
  transients do not count (the whole model is built on every rank before it is cut, as under ParcaeStrategy);
  at the end, peak anonymous = ``VmHWM - RssFile - RssShmem`` (file-backed pages -- shared-library code that a
  kernel's first call pages in -- no longer grow in steady state), minus the baseline ``RssAnon``. Every
  engine's processes import the same libraries before the baseline (the model module ``examples/gpt/gpt.py``
  imports Lightning), so what remains is parameters, gradients, optimizer state, activations kept for backward,
  communication buffers and what the C allocator keeps resident after a free (the same allocator for both
  engines). Why RSS and not ``tracemalloc``: tensors are allocated by c10's CPU allocator with
  ``posix_memalign``, which ``tracemalloc`` (Python's allocator only) never sees, and torch keeps no CPU
  allocator statistics. The absolute high-water mark is printed for the one-process run too. ParcaeStrategy keeps
  the *structure* of the layers other stages hold on every stage (its full stack, so that the stack can be re-cut
  after a membership change) but not their parameters (``meta`` until a migration hands them over); the bytes of
  such parameters that still have storage on a stage are printed per stage (0 unless a weight is tied to a held
  layer), with the worst ratio they leave without them. Each stage's peak is also split into its **set-up** share
  (anonymous RSS at the first timed step above the baseline: parameters, optimizer state, process groups, the
  framework's objects, thread stacks) and the **rise** the timed steps add on top (activations, gradients,
  buffers in flight), with the process's thread count: a gap in set-up is what a process holds before the
  schedule runs, a gap in the rise is the schedule's. The high-water mark of everything before the timed steps
  (start-up and warm-up) is printed too: a transient there (a full-batch pass) would show in it.
- **live tensor peak per stage**: what a GPU's ``max_memory_allocated`` would report, without any allocator's
  cache -- RSS includes what glibc's malloc keeps after a free, which differs between the engines' allocation
  patterns by up to ~190 MiB on the head stage while their live tensors differ by a few MiB: with jemalloc
  preloaded (``LD_PRELOAD=.../libjemalloc.so.2``) or glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_=
  1048576``: large blocks always mapped and returned on free) the head stage's RSS gap reverses. Two untimed
  steps follow the timed ones under ``torch.profiler`` (``profile_memory=True``); the second is measured: tensors
  reachable from Python at its start (unique storages; nothing held only by C++ is alive between steps) plus the
  maximum of its allocations minus frees, in time order (:class:`_LiveTensors` says why two steps).
  ``BENCH_LIVE_DETAIL=/tmp/x`` also writes, per rank, the profiler's category breakdown at the peak to
  ``/tmp/x.RANK``.
- **bubble ratio** of a P-stage run with M micro-batches: ``samples/s(P) / (P x samples/s(one process) x
  M / (M + P - 1))`` -- the fraction of the GPipe/1F1B bubble bound ``M / (M + P - 1)`` reached, taking P
  perfectly balanced stages that each run at one process's speed as the ideal. It is 1.0 only with perfectly
  balanced stages, free transfers, and one free core per stage. Two more numbers bound what is reachable here:
  the **split balance** ``sum(layer times) / (P x slowest stage's layer times)`` of the profile the split was
  chosen from (an imbalance no engine can remove), and **cores / P** when P processes share fewer cores (on a
  2-core machine a P=4 run whose stages are all busy reaches at most 2/4 of P x one process; the two limits do not
  multiply, since an idle stage leaves its share of a core to the others). The same ratio is also printed against
  **one process over the same M micro-batches** (gradients accumulated, one step): a stage runs micro-batches of
  ``B / M`` samples, whose kernels differ in speed per sample from the full batch's, and that difference is the
  micro-batching's, not the pipeline's -- the textbook bound ``M / (M + P - 1)`` is relative to the same work
  done unpipelined. Both are printed; the issue's figure is the first. (On this 2-core CPU the micro-batches run
  0.99-1.31x *faster* per sample than the full batch -- smaller GEMMs stay in cache -- so here the second figure
  is the stricter one; on a GPU small micro-batches are usually slower.)

Every P-stage configuration is run with ``M = --micro-batches`` (one M per P, default 4 at P=2 and 8 at P=4: the
issue's (1,2) M=4 and (1,4) M=8 points). ``--global-batch`` must be divisible by every M.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # bench_strategy (the Parcae timer)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "examples", "gpt"))  # gpt.Block

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

__all__ = ["build_layers", "bubble_ratio", "main"]

ENGINES = ("parcae", "peer")
SCHEDULES = ("gpipe", "1f1b")


# ------------------------------------------------------------------------------------------------------ the model
class Embed(nn.Module):
    """Token + learned position embedding for a ``vocab``-token vocabulary."""

    def __init__(self, vocab: int, dim: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))[None]


def build_layers(cfg: dict[str, Any]) -> nn.Sequential:
    """The benchmark's GPT as one stack: embedding, ``cfg["blocks"]`` blocks, final LayerNorm, head.

    Args:
        cfg: run configuration with ``vocab``, ``dim``, ``heads``, ``blocks`` and ``seq``; with ``device_ms`` > 0
            every block also sleeps that many ms per sample in forward, twice as long in backward (``Block``'s
            emulated accelerator, :mod:`lightning_parcae.testing.emulated_device`: modelled kernel time on top of
            its arithmetic).

    Returns:
        An ``nn.Sequential`` of ``blocks + 3`` layers, initialised from ``torch.manual_seed(0)``.
    """
    from gpt import Block  # examples/gpt/gpt.py: pre-LayerNorm causal self-attention + MLP

    torch.manual_seed(0)
    ms = float(cfg.get("device_ms", 0.0))  # 0: no emulated time, the block's output unchanged
    return nn.Sequential(Embed(cfg["vocab"], cfg["dim"], cfg["seq"]),
                         *[Block(cfg["dim"], cfg["heads"], device_ms=ms) for _ in range(cfg["blocks"])],
                         nn.LayerNorm(cfg["dim"]), nn.Linear(cfg["dim"], cfg["vocab"]))


def _data(cfg: dict[str, Any]) -> TensorDataset:
    n = cfg["batch"] * (cfg["steps"] + cfg["warmup"] + 2)  # + the two profiled steps (_LiveTensors)
    tokens = torch.randint(0, cfg["vocab"], (n, cfg["seq"] + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def bubble_ratio(rate: float, one_process: float, stages: int, micro_batches: int) -> float:
    """Fraction of the bubble bound reached: ``rate / (P x one_process x M / (M + P - 1))``."""
    return rate / (stages * one_process * micro_batches / (micro_batches + stages - 1))


# ------------------------------------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class _Memory:
    """Anonymous RSS after the imports, then the peak over a reset point on (see the module docstring)."""

    def __init__(self) -> None:
        self.baseline_anon_kib = _status_kib("RssAnon")
        self.setup_anon_kib = self.baseline_anon_kib
        self.before_peak_kib = self.baseline_anon_kib
        self.threads = 0
        self.reset_ok = False

    def reset(self) -> None:
        """Restart the high-water mark (``VmHWM``) from the current RSS: the first timed step begins. What is
        resident then (parameters, optimizer state, process groups, the framework's objects, thread stacks) is
        the set-up share of the peak; the rest is what the timed steps add."""
        self.setup_anon_kib = _status_kib("RssAnon")
        # the high-water mark of everything before (start-up, warm-up steps), as anonymous memory
        self.before_peak_kib = _status_kib("VmHWM") - _status_kib("RssFile") - _status_kib("RssShmem")
        self.threads = _status_kib("Threads")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset_ok = True
        except OSError:  # pre-4.0 kernels / restricted /proc: the whole-life high-water mark is reported instead
            self.reset_ok = False

    def report(self) -> dict[str, Any]:
        """Peak RSS, and its anonymous part above the baseline (MiB), at the end of the timed steps."""
        hwm, file, shmem = _status_kib("VmHWM"), _status_kib("RssFile"), _status_kib("RssShmem")
        anon_peak = hwm - file - shmem
        return {"peak_rss_mib": hwm / 1024, "peak_above_baseline_mib": (anon_peak - self.baseline_anon_kib) / 1024,
                "setup_mib": (self.setup_anon_kib - self.baseline_anon_kib) / 1024,
                "before_peak_mib": (self.before_peak_kib - self.baseline_anon_kib) / 1024,
                "step_rise_mib": (anon_peak - self.setup_anon_kib) / 1024, "threads": self.threads,
                "file_mib": file / 1024, "hwm_reset": self.reset_ok}


class _LiveTensors:
    """Peak bytes of live tensors over one step, from the profiler's allocation records (allocator-independent).

    RSS says what the process holds, including what the C allocator keeps after a free, which moves by tens of MiB
    between runs of the same engine. This measures what a GPU's ``max_memory_allocated`` would. Two untimed steps
    follow the timed ones: the profiler (``profile_memory=True``: every allocation and free c10's CPU allocator
    makes) starts with the first, and the second is measured -- c10 reports the free of a block only if the block
    was allocated while profiling, so the first step is there to have the previous step's gradients and
    activations allocated under the profiler. At the second step's start (:meth:`mark`) the storages of the tensors
    reachable from Python are summed (parameters, gradients, optimizer state: unique storages, ``meta`` skipped);
    the step's allocations and frees are then added in time order; peak = that start + the sum's maximum.
    """

    _MARK = "bench_pipeline_peer.live_mark"

    def __init__(self) -> None:
        self.prof: Any = None
        self.start_bytes = 0
        self.peak_rise_bytes = 0

    @staticmethod
    def _reachable_bytes() -> int:
        import gc
        import warnings

        seen: dict[int, int] = {}
        with warnings.catch_warnings():  # isinstance() on deprecated module attributes (torch.distributed.reduce_op)
            warnings.simplefilter("ignore")
            objects = gc.get_objects()
            tensors = [o for o in objects if isinstance(o, torch.Tensor)]
        del objects
        for obj in tensors:
            try:
                if obj.is_meta or obj.device.type != "cpu":
                    continue
                st = obj.untyped_storage()
                seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
            except (RuntimeError, ReferenceError):  # a tensor without storage (sparse, functional wrappers)
                continue
        return sum(seen.values())

    def start(self) -> None:
        """Start profiling (the first untimed step begins)."""
        from torch.profiler import ProfilerActivity, profile

        detail = bool(os.environ.get("BENCH_LIVE_DETAIL"))
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=detail,
                            with_stack=detail)
        self.prof.__enter__()

    def mark(self) -> None:
        """The measured step begins: what is live now, and a marker in the profile's clock."""
        self.start_bytes = self._reachable_bytes()
        with torch.profiler.record_function(self._MARK):
            pass

    def stop(self) -> None:
        """Stop profiling (the measured step ended) and take the peak."""
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        events = self.prof.profiler.kineto_results.events()
        marks = [e.start_ns() for e in events if e.name() == self._MARK]
        since = marks[-1] if marks else 0
        mem = sorted((e for e in events if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
                      and e.start_ns() >= since), key=lambda e: e.start_ns())
        cur = peak = 0
        for e in mem:
            cur += e.nbytes()
            peak = max(peak, cur)
        self.peak_rise_bytes = peak
        if os.environ.get("BENCH_LIVE_DETAIL"):  # where the peak is, by the profiler's categories (diagnosis)
            from torch.profiler import _memory_profiler as mp

            times, sizes = mp.MemoryProfileTimeline(self.prof._memory_profile())._coalesce_timeline("cpu")
            i = max(range(len(sizes)), key=lambda k: sum(sizes[k]) if times[k] * 1000 >= since else -1)
            names = ["unknown"] + [c.name for c in mp.Category]
            with open(os.environ["BENCH_LIVE_DETAIL"] + f".{os.environ.get('LOCAL_RANK')}", "a") as f:
                f.write(", ".join(f"{n} {v / 2**20:.1f}" for n, v in zip(names, sizes[i]) if v) + "\n")
        self.prof = None

    def report(self) -> dict[str, Any]:
        """``live_peak_mib`` (start + rise), ``live_start_mib``, MiB."""
        return {"live_peak_mib": (self.start_bytes + self.peak_rise_bytes) / 2**20,
                "live_start_mib": self.start_bytes / 2**20}


_LIVE = _LiveTensors()


class _Spans:
    """Wall time per named part of the timed steps (``--diagnose``); wraps callables, counts only once started."""

    def __init__(self) -> None:
        self.on = False
        self.total: dict[str, float] = {}

    def wrap(self, name: str, fn: Any) -> Any:
        """``fn`` with its wall time added to ``name`` while the timed steps run."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t0
        return timed

    def per_step_ms(self, steps: int) -> dict[str, float]:
        """Milliseconds per timed step of every part."""
        return {k: 1000.0 * v / steps for k, v in self.total.items()}


_SPANS = _Spans()


def _instrument_parcae() -> None:
    """Time ParcaeStrategy's schedule, its blocking receives, its sends' final wait and its per-step broadcast."""
    from lightning_parcae.runtime import pipeline
    from lightning_parcae.training import step_runner

    step_runner.run_train_schedule = _SPANS.wrap("schedule (fwd+bwd+p2p)", step_runner.run_train_schedule)
    step_runner.StepRunner.training_step = _SPANS.wrap("training_step (schedule+split+outcome)",
                                                       step_runner.StepRunner.training_step)
    step_runner.StepRunner.share_outcome = _SPANS.wrap("outcome broadcast", step_runner.StepRunner.share_outcome)
    pipeline.P2P.recv = _SPANS.wrap("blocked: recv activation", pipeline.P2P.recv)
    pipeline.P2P.recv_like = _SPANS.wrap("blocked: recv gradient", pipeline.P2P.recv_like)
    pipeline.P2P.wait_all = _SPANS.wrap("blocked: wait sends", pipeline.P2P.wait_all)


# ------------------------------------------------------------------------------------------------------ workers
def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _write(cfg: dict[str, Any], rank: int, result: dict[str, Any]) -> None:
    with open(f"{cfg['out']}.{rank}", "w") as f:
        json.dump(result, f)


def _single_worker(cfg: dict[str, Any], mem: _Memory) -> None:
    """One process, plain PyTorch: the whole model, one SGD step per batch -- on the full batch at once (``M`` = 1)
    or over ``M`` micro-batches with their gradients accumulated (the same kernels a stage of an M-micro-batch
    pipeline runs, without the pipeline)."""
    model = build_layers(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    m = int(cfg.get("M", 1))
    t0, rate, rss = 0.0, 0.0, {}

    def step_on(x: torch.Tensor, y: torch.Tensor) -> None:
        if m == 1:
            _loss(model(x), y).backward()
            return
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (_loss(model(xs), ys) / m).backward()

    for step, (x, y) in enumerate(DataLoader(_data(cfg), batch_size=cfg["batch"])):
        if step == cfg["warmup"]:
            mem.reset()
            t0 = time.perf_counter()
        if step == cfg["warmup"] + cfg["steps"]:  # the profiled steps, after the timed ones
            rate, rss = cfg["batch"] * cfg["steps"] / (time.perf_counter() - t0), mem.report()
            _LIVE.start()
        if step == cfg["warmup"] + cfg["steps"] + 1:
            _LIVE.mark()
        step_on(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
    _LIVE.stop()
    _write(cfg, 0, {"samples_per_s": rate, **rss, **_LIVE.report()})


def _parcae_worker(cfg: dict[str, Any], mem: _Memory) -> None:
    """ParcaeStrategy at D=1 x P inside ``pl.Trainer``; the loss is logged as a real training step would."""
    import pytorch_lightning as pl

    from bench_strategy import _Timer
    from lightning_parcae.training.strategy import ParcaeStrategy

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_layers(cfg)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.net(tokens)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = _loss(self(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Timer(_Timer):
        rss: dict[str, Any] = {}

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == self.warmup:
                mem.reset()
                _SPANS.on = cfg.get("diagnose", False)
            if trainer.global_step == self.warmup + cfg["steps"] + 1:  # the measured step
                _LIVE.mark()
                return
            if trainer.global_step == self.warmup + cfg["steps"]:  # the profiled steps, after the timed ones
                self.rss, _SPANS.on = mem.report(), False
                _LIVE.start()
                return
            super().on_train_batch_start(trainer, *args)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step > self.warmup + cfg["steps"]:
                if trainer.global_step > self.warmup + cfg["steps"] + 1:
                    _LIVE.stop()
                return
            super().on_train_batch_end(trainer, *args)

    if cfg.get("diagnose", False):
        _instrument_parcae()

    pl.seed_everything(0, verbose=False)
    strategy = ParcaeStrategy(pipeline_stages=cfg["P"], micro_batches=cfg["M"], schedule=cfg["schedule"],
                              balance=cfg["balance"])
    timer = Timer(cfg["warmup"])
    trainer = pl.Trainer(accelerator="cpu", devices=cfg["P"], strategy=strategy,
                         max_steps=cfg["steps"] + cfg["warmup"] + 2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[timer])
    trainer.fit(LM(), DataLoader(_data(cfg), batch_size=cfg["batch"]))
    rank = trainer.global_rank
    result: dict[str, Any] = {"partition": list(strategy.partition), **timer.rss, **_LIVE.report(),
                              "parts_ms": _SPANS.per_step_ms(cfg["steps"]),
                              "elastic_copy_mib": _elastic_copy_mib(strategy, trainer.lightning_module)}
    if rank == 0:
        result["samples_per_s"] = cfg["batch"] * cfg["steps"] / (timer.t1 - timer.t0)
    _write(cfg, rank, result)


def _elastic_copy_mib(strategy: Any, module: Any) -> float:
    """MiB of parameters of the layers other stages hold that still have storage on this stage (ParcaeStrategy's
    full stack keeps those layers' structure, their parameters on ``meta``; 0 unless a weight is tied to a held
    layer). They would be part of the measured peak."""
    full = strategy.full_stack
    if full is None:
        return 0.0
    local = {id(p) for p in module.parameters()}
    return sum(p.numel() * p.element_size() for p in full.parameters() if id(p) not in local and not p.is_meta) / 2**20


def _peer_worker(cfg: dict[str, Any], mem: _Memory) -> None:
    """torch.distributed.pipelining: this rank's ``PipelineStage`` over its layers, the same schedule and step."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = _rank_world()
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    layers = list(build_layers(cfg))  # built whole, then cut, as under ParcaeStrategy
    start = sum(cfg["balance"][:rank])
    stage_module = nn.Sequential(*layers[start:start + cfg["balance"][rank]])
    del layers
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.01)
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg["schedule"]]
    schedule = kind(stage, n_microbatches=cfg["M"], loss_fn=_loss)  # scale_grads: gradients / M, as Parcae
    run = _SPANS.wrap("schedule (fwd+bwd+p2p)", schedule.step)
    step_opt = _SPANS.wrap("optimizer step + zero_grad", lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
    t0 = t1 = 0.0
    rss: dict[str, Any] = {}
    for step, (x, y) in enumerate(DataLoader(_data(cfg), batch_size=cfg["batch"])):
        if step == cfg["warmup"]:
            mem.reset()
            _SPANS.on = cfg.get("diagnose", False)
            t0 = time.perf_counter()
        if step == cfg["warmup"] + cfg["steps"]:  # the profiled steps, after the timed ones
            t1, rss, _SPANS.on = time.perf_counter(), mem.report(), False
            _LIVE.start()
        if step == cfg["warmup"] + cfg["steps"] + 1:
            _LIVE.mark()
        if rank == 0:
            run(x)
        elif rank == world - 1:
            run(target=y, losses=[], return_outputs=False)
        else:
            run()
        step_opt()
    _LIVE.stop()
    result: dict[str, Any] = {"partition": list(cfg["balance"]), **rss, **_LIVE.report(),
                              "parts_ms": _SPANS.per_step_ms(cfg["steps"])}
    if rank == 0:
        result["samples_per_s"] = cfg["batch"] * cfg["steps"] / (t1 - t0)
    _write(cfg, rank, result)
    dist.barrier()
    dist.destroy_process_group()


def _worker(cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    modules = ["gpt"] + {"parcae": ["pytorch_lightning", "lightning_parcae.training.strategy", "bench_strategy"],
                         "peer": ["torch.distributed.pipelining"]}.get(cfg["engine"], [])
    for name in modules:  # each engine's libraries are imported before the baseline is taken
        importlib.import_module(name)
    mem = _Memory()  # after the imports, before any model exists
    {"single": _single_worker, "parcae": _parcae_worker, "peer": _peer_worker}[cfg["engine"]](cfg, mem)


# ------------------------------------------------------------------------------------------------------- driver
def _launch(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Run one configuration in ``cfg["P"]`` fresh processes; one result per rank."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    os.unlink(out)
    cfg = {**cfg, "out": out}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(cfg["P"]):
        env = {**os.environ, "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(cfg["P"]),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    errors = [p.communicate(timeout=900)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{cfg['engine']} P={cfg['P']} {cfg.get('schedule')} failed:\n"
                           + b"\n".join(e[-3000:] for e in errors).decode(errors="replace"))
    results = []
    for rank in range(cfg["P"]):
        with open(f"{out}.{rank}") as f:
            results.append(json.load(f))
        os.unlink(f"{out}.{rank}")
    return results


def _split(cfg: dict[str, Any], stages: list[int], micro: dict[int, int]) -> tuple[dict[int, list[int]],
                                                                                   dict[int, float]]:
    """Layers per stage for each P (the project's min-max partitioner over a profile of one micro-batch)."""
    from lightning_parcae.runtime.partition import balance_stages, profile_layer_times

    torch.set_num_threads(1)
    layers = build_layers(cfg)
    splits, balance = {}, {}
    for p in stages:
        sample = torch.randint(0, cfg["vocab"], (cfg["batch"] // micro[p], cfg["seq"]),
                               generator=torch.Generator().manual_seed(1))
        times = profile_layer_times(layers, sample, repeats=3)
        splits[p] = balance_stages(times, p)
        sums, start = [], 0
        for n in splits[p]:
            sums.append(sum(times[start:start + n]))
            start += n
        balance[p] = sum(times) / (p * max(sums))
    return splits, balance


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "uptime unavailable"


def _fmt_mem(results: list[dict[str, Any]]) -> str:
    return "/".join(f"{r['peak_above_baseline_mib']:.0f}" for r in results)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """Run the comparison and print it; returns the measured rows (for the smoke test).

    Args:
        argv: command-line arguments (``None``: ``sys.argv[1:]``).

    Returns:
        ``{"rows": {name: {...}}, "one_process": samples/s, "splits": {P: layers per stage}}``.
    """
    ap = argparse.ArgumentParser(description="ParcaeStrategy vs torch.distributed.pipelining on one GPT-style "
                                             "model: samples/s and peak memory per stage")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=128, help="model width")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8, help="transformer blocks (the stack has blocks + 3 layers)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", "--global-batch", dest="batch", type=int, default=32,
                    help="global batch (D=1: the pipeline's batch); divisible by every M")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="pipeline depths P")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8],
                    help="M for each P of --stages, in the same order")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration (interleaved); the best is kept")
    ap.add_argument("--device-ms-per-sample", type=float, default=0.0,
                    help="emulated accelerator: every block also sleeps this many ms per sample in forward (2x in "
                         "backward), so that the schedule, not the CPU cores, sets the bubble; keep the real model "
                         "small (e.g. --vocab 256 --dim 32). 0 (default): real compute only")
    ap.add_argument("--diagnose", action="store_true",
                    help="also time the parts of each step on every rank (schedule, blocking receives, the "
                         "per-step outcome broadcast; the peer: schedule and optimizer) and print them")
    args = ap.parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return {}
    if len(args.micro_batches) != len(args.stages):
        ap.error(f"--micro-batches {args.micro_batches} needs one M per P of --stages {args.stages}")
    micro = dict(zip(args.stages, args.micro_batches))
    for p, m in micro.items():
        if args.batch % m:
            ap.error(f"--batch {args.batch} is not divisible by M={m} (P={p}); pick a multiple of every M")
        if p > args.blocks + 3:
            ap.error(f"P={p} is deeper than the stack ({args.blocks + 3} layers)")
    base = {"vocab": args.vocab, "dim": args.dim, "heads": args.heads, "blocks": args.blocks, "seq": args.seq,
            "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "diagnose": args.diagnose,
            "device_ms": args.device_ms_per_sample}
    if args.device_ms_per_sample < 0:
        ap.error(f"--device-ms-per-sample {args.device_ms_per_sample} must be >= 0 (0: real compute only)")
    load_before = _uptime()
    started = time.perf_counter()
    splits, balance = _split(base, args.stages, micro)
    configs: dict[str, dict[str, Any]] = {"one process": {**base, "engine": "single", "P": 1, "M": 1}}
    for m in sorted(set(micro.values())):  # the same micro-batches, accumulated: the per-stage kernels' speed
        configs[f"one process M={m}"] = {**base, "engine": "single", "P": 1, "M": m}
    for p in args.stages:
        for schedule in args.schedules:
            for engine in args.engines:
                configs[f"{engine} P={p} {schedule} M={micro[p]}"] = {
                    **base, "engine": engine, "P": p, "M": micro[p], "schedule": schedule, "balance": splits[p]}
    best: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):  # interleaved, so that background load hits every configuration alike
        for name, cfg in configs.items():
            res = _launch(cfg)
            if name not in best or res[0]["samples_per_s"] > best[name][0]["samples_per_s"]:
                best[name] = res
    elapsed = time.perf_counter() - started
    one = best["one process"][0]["samples_per_s"]
    one_at = {m: best[f"one process M={m}"][0]["samples_per_s"] for m in set(micro.values())}
    cores = os.cpu_count() or 1

    emulated = (f"; emulated device: {args.device_ms_per_sample:g} ms/sample forward, 2x backward per block "
                "(modelled; the rest real)" if args.device_ms_per_sample > 0 else "")
    print(f"GPT-style LM: vocab {args.vocab}, d {args.dim}, {args.blocks} blocks (+ embedding, final norm, head), "
          f"seq {args.seq}, global batch {args.batch}, SGD; CPU, gloo, 1 thread/process, {cores} cores; "
          f"{args.steps} timed steps after {args.warmup}, best of {args.repeats}; {elapsed:.0f} s{emulated}")
    print(f"  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; load before: {load_before}")
    print(f"  load after: {_uptime()}")
    for p in args.stages:
        print(f"  split at P={p} (layers per stage, both engines): {splits[p]}   split balance "
              f"{balance[p]:.3f}   cores/P {min(1.0, cores / p):.2f}")
    one_mem = best["one process"][0]
    print(f"  one process: {one:.1f} samples/s, peak memory {one_mem['peak_above_baseline_mib']:.0f} MiB above "
          f"baseline ({one_mem['peak_rss_mib']:.0f} MiB RSS)")
    print("  one process over M micro-batches (gradients accumulated): "
          + ", ".join(f"M={m} {v:.1f} samples/s ({v / one:.3f} of the full batch)" for m, v in sorted(one_at.items())))
    print()
    header = (f"  {'P':>2} {'M':>2} {'schedule':<8} | {'Parcae s/s':>10} {'peer s/s':>9} {'ratio':>6} | "
              f"{'Parcae bubble':>13} {'peer bubble':>11} | {'peak MiB/stage Parcae':>22} {'peer':>16} "
              f"{'worst ratio':>11}")
    print(header)
    print("  " + "-" * (len(header) - 2))
    rows: dict[str, dict[str, Any]] = {}
    for p in args.stages:
        m = micro[p]
        for schedule in args.schedules:
            got = {e: best.get(f"{e} P={p} {schedule} M={m}") for e in ENGINES}
            row: dict[str, Any] = {"P": p, "M": m, "schedule": schedule}
            for e, res in got.items():
                if res is not None:
                    row[e] = {"samples_per_s": res[0]["samples_per_s"],
                              "bubble_ratio": bubble_ratio(res[0]["samples_per_s"], one, p, m),
                              "bubble_ratio_micro": bubble_ratio(res[0]["samples_per_s"], one_at[m], p, m),
                              "peak_above_baseline_mib": [r["peak_above_baseline_mib"] for r in res],
                              "setup_mib": [r.get("setup_mib", 0.0) for r in res],
                              "step_rise_mib": [r.get("step_rise_mib", 0.0) for r in res],
                              "before_peak_mib": [r.get("before_peak_mib", 0.0) for r in res],
                              "threads": [r.get("threads", 0) for r in res],
                              "peak_rss_mib": [r["peak_rss_mib"] for r in res],
                              "live_peak_mib": [r.get("live_peak_mib", 0.0) for r in res],
                              "live_start_mib": [r.get("live_start_mib", 0.0) for r in res]}
                    if e == "parcae":
                        row[e]["elastic_copy_mib"] = [r.get("elastic_copy_mib", 0.0) for r in res]
            both = "parcae" in row and "peer" in row
            if both:
                row["throughput_ratio"] = row["parcae"]["samples_per_s"] / row["peer"]["samples_per_s"]
                row["memory_ratio"] = max(a / b for a, b in zip(row["parcae"]["peak_above_baseline_mib"],
                                                                row["peer"]["peak_above_baseline_mib"]))
                row["live_ratio"] = max(a / b for a, b in zip(row["parcae"]["live_peak_mib"],
                                                              row["peer"]["live_peak_mib"]) if b > 0)
                row["memory_ratio_without_copy"] = max(
                    (a - c) / b for a, b, c in zip(row["parcae"]["peak_above_baseline_mib"],
                                                   row["peer"]["peak_above_baseline_mib"],
                                                   row["parcae"]["elastic_copy_mib"]))
            rows[f"P={p} {schedule}"] = row

            def cell(e: str, key: str, fmt: str) -> str:
                return format(row[e][key], fmt) if e in row else "-"

            print(f"  {p:>2} {m:>2} {schedule:<8} | {cell('parcae', 'samples_per_s', '10.1f'):>10} "
                  f"{cell('peer', 'samples_per_s', '9.1f'):>9} "
                  f"{format(row['throughput_ratio'], '6.3f') if both else '-':>6} | "
                  f"{cell('parcae', 'bubble_ratio', '13.3f'):>13} {cell('peer', 'bubble_ratio', '11.3f'):>11} | "
                  f"{_fmt_mem(got['parcae']) if got['parcae'] else '-':>22} "
                  f"{_fmt_mem(got['peer']) if got['peer'] else '-':>16} "
                  f"{format(row['memory_ratio'], '11.3f') if both else '-':>11}")
    print()
    print("  ratio = Parcae / peer samples/s (goal >= 0.95); bubble = samples/s / (P x one process x M/(M+P-1)) "
          "(goal >= 0.95 at P=2 M=4 and P=4 M=8;")
    print("  at most the split balance, and cores/P if every stage is busy); peak MiB/stage = peak anonymous RSS "
          "over the timed steps minus the import baseline, stage 0/1/...;")
    print("  worst ratio = max over stages of Parcae / peer peak memory (goal <= 1.05).")
    for name, r in rows.items():
        if "memory_ratio_without_copy" in r:
            copy = "/".join(f"{c:.0f}" for c in r["parcae"]["elastic_copy_mib"])
            print(f"  {name}: of Parcae's peak, {copy} MiB per stage are the other stages' parameters it keeps for "
                  f"re-partitioning (host memory on a GPU); without them the worst ratio is "
                  f"{r['memory_ratio_without_copy']:.3f}")
    print("  where each stage's peak comes from, MiB (set-up = resident at the first timed step above the import "
          "baseline: parameters, optimizer state, groups, framework, thread stacks; rise = peak - set-up: what the "
          "timed steps add), threads per process:")
    for name, r in rows.items():
        for e in ENGINES:
            if e in r and "setup_mib" in r[e]:
                per = ", ".join(f"{s:.1f}+{q:.1f}" for s, q in zip(r[e]["setup_mib"], r[e]["step_rise_mib"]))
                before = "/".join(f"{v:.0f}" for v in r[e]["before_peak_mib"])
                print(f"  {name} {e:>6}: set-up+rise per stage {per}; threads {'/'.join(map(str, r[e]['threads']))}; "
                      f"peak before the timed steps {before}")
    print("  live tensor peak per stage, MiB (a profiled step after the timed ones: storages reachable from "
          "Python at its start + the peak of the allocations it makes; no allocator cache -- a GPU's "
          "max_memory_allocated), and the worst Parcae / peer ratio:")
    print(f"  one process: {one_mem.get('live_peak_mib', 0.0):.1f}")
    for name, r in rows.items():
        per = {e: "/".join(f"{v:.1f} (start {b:.1f})" for v, b in zip(r[e]["live_peak_mib"], r[e]["live_start_mib"]))
               for e in ENGINES if e in r}
        worst = f"; worst {r['live_ratio']:.3f}" if "live_ratio" in r else ""
        print(f"  {name}: Parcae {per.get('parcae', '-')} vs peer {per.get('peer', '-')}{worst}")
    losses = [f"{name}: {r['throughput_ratio']:.3f}" for name, r in rows.items()
              if "throughput_ratio" in r and r["throughput_ratio"] < 0.95]
    heavier = [f"{name}: {r['memory_ratio']:.3f}" for name, r in rows.items()
               if "memory_ratio" in r and r["memory_ratio"] > 1.05]
    print("  bubble against one process over the same M micro-batches (samples/s / (P x one process at M x "
          "M/(M+P-1)): the bound without the full batch's larger kernels):")
    for name, r in rows.items():
        per = ", ".join(f"{'Parcae' if e == 'parcae' else 'peer'} {r[e]['bubble_ratio_micro']:.3f}"
                        for e in ENGINES if e in r)
        print(f"  {name} M={r['M']}: {per}")
    print(f"  Parcae below 0.95 of the peer's samples/s: {', '.join(losses) or 'none'}")
    print(f"  Parcae above 1.05 of the peer's peak memory: {', '.join(heavier) or 'none'}")
    if args.diagnose:
        print()
        print("  where the time of a timed step goes (ms per step, per rank; rank 0 = first stage):")
        for name, res in best.items():
            if name.startswith("one process"):
                continue
            step_ms = 1000.0 * args.batch / res[0]["samples_per_s"]
            print(f"  {name} (step {step_ms:.0f} ms)")
            for rank, r in enumerate(res):
                parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["parts_ms"].items()))
                print(f"    rank {rank}: {parts}")
    return {"rows": rows, "one_process": one, "one_process_micro": one_at, "splits": splits,
            "split_balance": balance}


if __name__ == "__main__":
    main()
