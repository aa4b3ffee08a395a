"""Micro-batch pipeline execution: stage modules, GPipe and 1F1B schedules, point-to-point activation transfer.

Problem: with the layer stack cut into P stages on P processes, one training step must (1) split the pipeline's
batch into M micro-batches, (2) push each micro-batch forward through the stages and its gradient back, in an order
that keeps every stage busy (GPipe: all forwards then all backwards; 1F1B: after a warm-up, alternate one forward
and one backward so at most P micro-batches are in flight), and (3) do so over point-to-point send/recv without
deadlock. The user's own ``training_step`` must still compute the loss, so the first and last stage run it with the
layer stack replaced by a :class:`StageProxy` that runs only the local stage and connects it to the neighbours.

Transfer protocol between adjacent stages (same on gloo and NCCL): for micro-batch ``m`` the sender posts a small
int64 header (ndim, dtype, shape) and then the activation; the gradient of that activation comes back with the
shape already known. Tags ``3m``, ``3m+1``, ``3m+2`` keep the three messages of a micro-batch apart on backends that
honour tags.

Sends are asynchronous (``isend``) and overlap the compute that follows them; a send's tensor must stay alive until
its work is waited, and on gloo a send completes only once the peer has posted the matching receive (measured:
``is_completed()`` stays False until ``wait()``, and a send to a peer that has not posted its receive does not
finish). So a send cannot be polled, only waited, and waiting one too early can block on the peer. Each is therefore
waited -- and its tensor released -- at the first point where the peer is *known* to have received it, so that a
stage holds what the schedule keeps in flight, not all M micro-batches' messages (issue 22):

* the activation of micro-batch ``m`` (and every earlier one) when the gradient of ``m`` comes back (the next
  stage ran its forward of ``m`` first); under 1F1B at most ``P - stage`` are outstanding;
* a gradient sent back: at most :data:`SEND_WINDOW` per peer stay outstanding; posting one more first waits the
  oldest (the previous stage receives gradients in order and never waits on this stage to get there, so the wait
  cannot deadlock);
* in evaluation (forward only, data flows one way) the same window applies to activations;
* whatever is left, at the end of the step.

On gloo (CPU) the receives a stage is sure to need next are pre-posted -- the header of the next activation, the
gradients of the next backwards -- so that the bytes move while the stage computes; NCCL matches point-to-point
operations in issue order rather than by tag, so there every receive is posted when it is needed. A step that fails
(a lost peer surfaces as :class:`~lightning_parcae.errors.PeerLostError` from the wait that notices it) hands its
outstanding operations to :meth:`P2P.abandon`: an abandoned operation may still complete later and write into its
buffers, so they are parked, never reused.

On an emulated cluster (a modelled link installed, :mod:`lightning_parcae.runtime.link`, and the stage's layers
given to :class:`P2P`) every send first sleeps what the real model's message would take on the modelled network,
as a blocking send at the link's speed: the tiny model's activations stand for, e.g., GPT-1.5B's 3.3 MB per sample.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parcae.runtime.link import charge_boundary
from lightning_parcae.runtime.liveness import active, guarded, guarded_post, guarded_wait
from lightning_parcae.runtime.torch_internals import children
from lightning_parcae.errors import BatchSplitError, ConfigurationError, ModelLayoutError

__all__ = [
    "Op",
    "schedule_ops",
    "split_micro_batches",
    "batch_size_of",
    "chunk_batch",
    "StageBoundary",
    "StageProxy",
    "BlockListProxy",
    "hidden_of",
    "is_kv_cache",
    "without_caches",
    "P2P",
    "SEND_WINDOW",
    "run_train_schedule",
    "run_forward_only",
]

Op = tuple[Literal["F", "B"], int]
_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]
_MAX_NDIM = 8
SEND_WINDOW = 2
"""Sends per peer and kind that may be outstanding where no message from the peer tells that they arrived (gradients
sent back, evaluation activations); posting one more first waits the oldest."""
PREPOST_GRADIENTS = 2
"""Gradient receives pre-posted ahead of the backwards that need them (gloo)."""


# ---------------------------------------------------------------------------------------------------- schedules
def schedule_ops(kind: str, stage: int, pipeline_stages: int, micro_batches: int) -> list[Op]:
    """The ordered forward/backward operations of one stage for one step.

    Args:
        kind: ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"`` (warm-up of ``P - stage - 1`` forwards,
            then one forward / one backward, then the remaining backwards).
        stage: this stage's index.
        pipeline_stages: P.
        micro_batches: M.

    Returns:
        A list of ``("F", m)`` / ``("B", m)``; every micro-batch appears once in each phase, forwards and
        backwards each in increasing ``m``.

    Raises:
        ConfigurationError: on an unknown schedule name.
    """
    m_total = micro_batches
    if kind == "gpipe":
        return [("F", m) for m in range(m_total)] + [("B", m) for m in range(m_total)]
    if kind == "1f1b":
        warmup = min(pipeline_stages - stage - 1, m_total)
        ops: list[Op] = [("F", m) for m in range(warmup)]
        for i in range(m_total - warmup):
            ops.append(("F", warmup + i))
            ops.append(("B", i))
        ops.extend(("B", m) for m in range(m_total - warmup, m_total))
        return ops
    raise ConfigurationError(f"unknown schedule {kind!r}; use 'gpipe' or '1f1b'")


# ---------------------------------------------------------------------------------------------------- batch split
def batch_size_of(batch: Any) -> Optional[int]:
    """The batch dimension of a batch (its first batched tensor's dim 0), ``None`` if it holds no batched tensor."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.ndim > 0 else None
    if isinstance(batch, dict):
        items: Sequence[Any] = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return None
    for item in items:
        n = batch_size_of(item)
        if n is not None:
            return n
    return None


def _split_leaf(x: Any, bounds: list[tuple[int, int]], size: int) -> list[Any]:
    if isinstance(x, Tensor) and x.ndim > 0:
        if x.shape[0] != size:
            raise BatchSplitError(
                f"batch tensors disagree on the batch dimension: found {x.shape[0]} and {size}; every tensor in the "
                "batch must have the batch size as its first dimension"
            )
        return [x[a:b] for a, b in bounds]
    if isinstance(x, dict):
        parts = {k: _split_leaf(v, bounds, size) for k, v in x.items()}
        return [type(x)((k, parts[k][i]) for k in x) for i in range(len(bounds))]
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        parts_nt = [_split_leaf(v, bounds, size) for v in x]
        return [type(x)(*(p[i] for p in parts_nt)) for i in range(len(bounds))]
    if isinstance(x, (list, tuple)):
        parts_seq = [_split_leaf(v, bounds, size) for v in x]
        return [type(x)(p[i] for p in parts_seq) for i in range(len(bounds))]
    return [x for _ in bounds]


def split_micro_batches(batch: Any, micro_batches: int) -> list[Any]:
    """Split a batch (tensor / tuple / list / dict / namedtuple of tensors) into equal micro-batches along dim 0.

    Non-tensor leaves and 0-d tensors are repeated in every micro-batch.

    Args:
        batch: one pipeline's batch.
        micro_batches: M.

    Returns:
        M micro-batches of the same structure.

    Raises:
        BatchSplitError: if the batch size is not divisible by M, or tensors disagree on the batch size.
    """
    size = batch_size_of(batch)
    if size is None:
        if micro_batches == 1:
            return [batch]
        raise BatchSplitError(f"cannot split a batch without tensors into {micro_batches} micro-batches")
    if micro_batches < 1 or size % micro_batches:
        raise BatchSplitError(
            f"a pipeline batch of {size} samples cannot be split into micro_batches={micro_batches} equal "
            f"micro-batches; choose micro_batches dividing {size} (global batch = D x {size})"
        )
    step = size // micro_batches
    return _split_leaf(batch, [(i * step, (i + 1) * step) for i in range(micro_batches)], size)


def chunk_batch(batch: Any, chunks: int) -> list[Any]:
    """Split a batch into at most ``chunks`` near-equal parts along dim 0 (for evaluation, where sizes may not divide).

    Args:
        batch: the batch.
        chunks: desired number of parts.

    Returns:
        ``min(chunks, batch size)`` parts (one part if the batch holds no batched tensor).
    """
    size = batch_size_of(batch)
    if size is None or size == 0:
        return [batch]
    n = max(1, min(chunks, size))
    base, extra = divmod(size, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return _split_leaf(batch, bounds, size)


# ---------------------------------------------------------------------------------------------------- stage proxy
class StageBoundary(Exception):
    """Raised by a :class:`StageProxy` in ``head``/``capture`` mode to stop the user's step after the local stage."""


class StageProxy(nn.Module):
    """Stands in for the model's layer stack while the user's step runs on one stage.

    Modes:
        ``full``: run the local stage on the given input (P = 1: the local stage is the whole stack).
        ``head``: run the local stage on the input, keep the output in :attr:`captured`, raise
            :class:`StageBoundary` (first stage of a deeper pipeline).
        ``tail``: ignore the input, run the local stage on :attr:`given` (the received activation) and return its
            output (last stage). The output is not kept: on a language model it is the logits, the largest tensor
            of the step, and a reference here would keep one micro-batch's logits alive into the next forward and
            across steps (issue 22: 32 MiB on the benchmark's head stage).
        ``given``: ignore the input and return :attr:`given` unchanged (mirror of the last stage's output).
        ``capture``: keep the input in :attr:`captured` and raise :class:`StageBoundary` (profiling).

    The local stage is referenced, not registered, so swapping the proxy in and out does not change the module's
    parameters or state-dict keys.
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_stage", stage)
        self.mode = "full"
        self.given: Optional[Tensor] = None
        self.captured: Optional[Tensor] = None

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        if self.mode == "capture":
            self.captured = x
            raise StageBoundary
        if self.mode == "given":
            return self.given
        inp = self.given if self.mode == "tail" else x
        out = self._stage(inp)  # type: ignore[operator]
        if self.mode == "head":
            self.captured = out
            raise StageBoundary
        return out


def hidden_of(out: Any) -> Any:
    """The hidden state of a block's output: the output itself, or the first element of a tuple/list."""
    return out[0] if isinstance(out, (tuple, list)) and out else out


def is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a key/value cache object (a ``transformers`` ``Cache``: it has ``update`` and
    ``get_seq_length``), recognised without importing ``transformers``."""
    return callable(getattr(value, "update", None)) and callable(getattr(value, "get_seq_length", None))


def _is_empty_cache(value: Any) -> bool:
    if not is_kv_cache(value):
        return False
    try:
        return int(value.get_seq_length()) == 0
    except Exception:  # noqa: BLE001 -- a cache we cannot read is left as it is
        return False


def without_caches(args: tuple, kwargs: dict[str, Any], empty_only: bool = True) -> tuple[tuple, dict[str, Any]]:
    """A block's arguments with key/value caches replaced by ``None`` (and ``use_cache=False`` if one was dropped).

    Under the pipeline a cache passed to the blocks would be filled on each stage with that stage's layers only, and
    in training it only holds activations alive; an *empty* cache changes nothing in a block's result, so it is
    dropped (``transformers`` creates one per forward when ``config.use_cache`` is on, training included). A
    prefilled cache (a prefix the user passes) is kept: every stage reads its own layers' entries.

    Args:
        args: positional arguments after the hidden state (GPT-2 passes its cache positionally).
        kwargs: keyword arguments (``cache=``, ``past_key_values=``, ``layer_past=``, ``use_cache=``, ...).
        empty_only: drop only empty caches (the pipeline); False drops every cache (the layer profile).

    Returns:
        ``(args, kwargs)``, the originals when nothing was dropped.
    """
    drop = _is_empty_cache if empty_only else is_kv_cache
    dropped = False
    if any(drop(a) for a in args):
        args, dropped = tuple(None if drop(a) else a for a in args), True
    if any(drop(v) for v in kwargs.values()):
        kwargs, dropped = {k: (None if drop(v) else v) for k, v in kwargs.items()}, True
    if dropped and kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


class _Entry(nn.Module):
    """One position of the block list as the user's loop sees it (not registered anywhere). Attributes the loop
    reads from a block (``decoder_layer.attention_type``) are the real block's."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__.get("_block")
            if block is None:
                raise
            return getattr(block, name)


class _Block(_Entry):
    """One owned block as the user's loop sees it under a :class:`BlockListProxy`."""

    def __init__(self, proxy: "BlockListProxy", block: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        object.__setattr__(self, "_proxy", proxy)
        object.__setattr__(self, "_block", block)
        self.first, self.last = first, last

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        proxy = self._proxy  # type: ignore[attr-defined]
        if self.first and proxy.mode in ("tail", "middle"):
            x = proxy.given  # the activation received from the previous stage replaces the local one
        args, kwargs = without_caches(args, kwargs)
        out = self._block(x, *args, **kwargs)  # type: ignore[operator]
        proxy.arity = len(out) if isinstance(out, (tuple, list)) else 0
        if self.last and proxy.mode in ("head", "middle"):  # kept only where it is read: see StageProxy's tail
            proxy.captured = hidden_of(out)
            raise StageBoundary
        return out


class _Elsewhere(_Entry):
    """A position whose block another stage holds: returns its hidden-state input unchanged, shaped like a block
    output. It only runs before this stage's first block (whose input is then replaced by the received
    activation), so that ``enumerate`` and ``len`` over the list count global positions."""

    def __init__(self, proxy: "BlockListProxy", block: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_proxy", proxy)
        object.__setattr__(self, "_block", block)

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        arity = self._proxy.arity  # type: ignore[attr-defined]
        return (x, *([None] * (arity - 1))) if arity else x


class _Given(nn.Module):
    """Stands in for all blocks in ``given`` mode: returns the last stage's output (shaped like a block output)."""

    def __init__(self, proxy: "BlockListProxy") -> None:
        super().__init__()
        object.__setattr__(self, "_proxy", proxy)

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        proxy = self._proxy  # type: ignore[attr-defined]
        if proxy.arity:
            return (proxy.given, *([None] * (proxy.arity - 1)))
        return proxy.given


class BlockListProxy(nn.Module):
    """Stands in for an ``nn.ModuleList`` of blocks that the user's ``forward`` loops over
    (``for block in self.blocks: x = block(x, mask)``), on one pipeline stage.

    Iterating it yields one entry per position of the whole list: this stage's blocks, and before them stand-ins
    for the blocks of earlier stages that pass their input through (their output is replaced by the received
    activation at this stage's first block), so ``enumerate(self.layers)`` counts global positions (Qwen2 picks a
    layer's mask by that index) and ``len`` is the model's depth. A slice (``self.layers[: config.num_hidden_layers]``,
    as ``transformers`` models loop) yields the same entries. Each block's first argument is the hidden state;
    further arguments -- positional or keyword: masks, positions, rotary tables -- are whatever the user's code
    computes, on every stage, since every stage runs the user's step up to its blocks. An empty key/value cache
    among them is dropped (:func:`without_caches`). A block may return a tuple whose first element is the hidden
    state. Attributes the loop reads from a block are the real block's.

    Modes (like :class:`StageProxy`): ``full`` (P = 1), ``head`` (stage 0: run the blocks, keep the output in
    :attr:`captured`, raise :class:`StageBoundary`), ``middle`` (the first block gets :attr:`given` instead of its
    input; stop after the last), ``tail`` (last stage: the first block gets :attr:`given`; go on to the loss),
    ``given`` (one stand-in block returns :attr:`given`: mirror of the last stage's output).

    Args:
        stage: this stage's blocks (an ``nn.ModuleList`` holding a contiguous run of the full list's names).
        full: the full block list, for the positions other stages hold; ``None``: only this stage's blocks are
            iterated.
        arity: the length of a block's output tuple (0: a tensor), if known (from the probe); otherwise it is
            learnt from this stage's first block call.
    """

    def __init__(self, stage: nn.ModuleList, full: Optional[nn.ModuleList] = None, arity: Optional[int] = None) \
            -> None:
        super().__init__()
        blocks = children(stage)
        held = {id(b) for b in blocks}
        entries: list[nn.Module] = []
        seen_first = False
        for b in (children(full) if full is not None else blocks):
            if id(b) in held:
                entries.append(_Block(self, b, not seen_first, False))
                seen_first = True
            elif not seen_first:
                entries.append(_Elsewhere(self, b))
            # positions after this stage's last block are never reached (its last block stops the step)
        owned = [e for e in entries if isinstance(e, _Block)]
        if owned:
            owned[-1].last = True
        object.__setattr__(self, "_entries", entries)
        object.__setattr__(self, "_given", [_Given(self)])
        self.depth = len(children(full)) if full is not None else len(blocks)
        self.mode = "full"
        self.given: Optional[Tensor] = None
        self.captured: Optional[Tensor] = None
        self.arity = arity or 0

    def _current(self) -> list[nn.Module]:
        return self._given if self.mode == "given" else self._entries  # type: ignore[attr-defined,return-value]

    def __iter__(self) -> Any:
        return iter(self._current())

    def __len__(self) -> int:
        return self.depth if self.mode != "given" else 1

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            positions = range(self.depth)[idx]
            if self.mode == "given":
                if list(positions) == list(range(self.depth)):
                    return list(self._given)  # type: ignore[attr-defined]
            else:
                return [e for i, e in enumerate(self._entries) if i in positions]  # type: ignore[attr-defined]
            raise ModelLayoutError(
                f"forward looped over a part of the block list ({idx}) under pipeline parallelism; only a loop over "
                "all its blocks can be cut. Loop over the whole list, or train with pipeline_stages=1")
        raise ModelLayoutError(
            "under pipeline parallelism (P > 1) forward must loop over the block list (`for block in self.blocks: "
            "x = block(x, ...)`); indexing it (self.blocks[i]) cannot be cut into stages. Loop over it, or train "
            "with pipeline_stages=1"
        )


# ---------------------------------------------------------------------------------------------------- transport
_ACT, _GRAD = "activation", "gradient"


class P2P:
    """Point-to-point tensor transfer with a shape header, plus a pipeline-group broadcast.

    Sends are kept per ``(peer, kind)`` channel until waited (see the module docstring for when): a send's work
    holds its tensor, so what is outstanding is what a stage keeps alive for the transport. Receives may be
    pre-posted (:meth:`prepost_header`, :meth:`prepost_like`) and are then picked up by :meth:`recv` /
    :meth:`recv_like` of the same source and tag.

    Args:
        device: device of the transferred tensors (CPU for gloo, this rank's GPU for NCCL).
        group: the pipeline group (for broadcasts).
        layers: ``(first, end)``: the layer indices this stage holds (``range(first, end)``), for the modelled
            link of an emulated cluster (:mod:`lightning_parcae.runtime.link`): an activation sent forward crosses
            the boundary after layer ``end - 1``, a gradient sent back the one after layer ``first - 1``. None
            (default): nothing is charged.

    Attributes:
        preposting: whether receives are pre-posted: only where the backend matches point-to-point operations by
            tag (gloo, i.e. a CPU device); NCCL matches them in issue order, so a receive posted early would hold
            up the sends issued after it.
    """

    def __init__(self, device: torch.device, group: Any = None, layers: Optional[tuple[int, int]] = None) -> None:
        self.device = device
        self.group = group
        self.layers = layers
        self.preposting = torch.device(device).type == "cpu"
        self._sends: dict[tuple[int, str], deque[tuple[int, list[Any]]]] = {}
        self._recvs: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        self._abandoned: list[Any] = []

    @property
    def outstanding_sends(self) -> int:
        """Posted send operations not yet waited (a header and its payload count as two)."""
        return sum(len(works) for chan in self._sends.values() for _, works in chan)

    def _header(self, t: Tensor) -> Tensor:
        if t.ndim > _MAX_NDIM:
            raise ModelLayoutError(f"stage outputs may have at most {_MAX_NDIM} dimensions, got {t.ndim}")
        if t.dtype not in _DTYPES:
            raise ModelLayoutError(f"stage output dtype {t.dtype} cannot be transferred")
        h = torch.zeros(2 + _MAX_NDIM, dtype=torch.int64, device=self.device)
        h[0], h[1] = t.ndim, _DTYPES.index(t.dtype)
        if t.ndim:
            h[2 : 2 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
        return h

    @staticmethod
    def _parse(h: Tensor) -> tuple[list[int], torch.dtype]:
        vals = h.tolist()
        return [int(v) for v in vals[2 : 2 + int(vals[0])]], _DTYPES[int(vals[1])]

    def send(self, t: Tensor, dst: int, tag: int, with_header: bool = True, window: Optional[int] = None) -> None:
        """Post an asynchronous send of ``t`` (and its header) to global rank ``dst``.

        Args:
            t: the tensor (a stage output, or the gradient of a received activation).
            dst: global rank of the peer.
            tag: the micro-batch index.
            with_header: send the shape header first (activations; a gradient's shape is known to the peer).
            window: if given, at most this many sends of this kind to ``dst`` stay outstanding: after posting,
                the oldest beyond it are waited. Only where the peer receives this channel in order without
                waiting on this stage (see the module docstring).
        """
        if not isinstance(t, Tensor):
            raise ModelLayoutError(
                f"a pipeline stage must return one tensor to pass to the next stage, got {type(t).__name__}"
            )
        data = t.detach().contiguous()
        if self.layers is not None:  # an emulated cluster's link: the real model's bytes, sent blocking
            charge_boundary(self.layers[1] - 1 if with_header else self.layers[0] - 1,
                            data.shape[0] if data.ndim else 1)
        works = []
        if with_header:
            header = self._header(data)
            works.append(guarded_post(lambda: dist.isend(header, dst, tag=3 * tag), "pipeline send"))
        works.append(guarded_post(lambda: dist.isend(data, dst, tag=3 * tag + (1 if with_header else 2)),
                                  "pipeline send"))
        chan = self._sends.setdefault((dst, _ACT if with_header else _GRAD), deque())
        chan.append((tag, works))
        if window is not None:
            while len(chan) > window:
                self._wait_one(chan)

    def _wait_one(self, chan: deque[tuple[int, list[Any]]]) -> None:
        _, works = chan[0]
        while works:
            guarded_wait(works[0], "pipeline send")
            works.pop(0)
        chan.popleft()

    def release(self, dst: int, upto: int) -> None:
        """Wait the activation sends to ``dst`` of micro-batches ``<= upto``: call it once ``dst`` is known to have
        received them (its gradient of ``upto`` arrived), so the waits return at once and the tensors are freed."""
        chan = self._sends.get((dst, _ACT))
        while chan and chan[0][0] <= upto:
            self._wait_one(chan)

    def prepost_header(self, src: int, tag: int) -> None:
        """Post the receive of micro-batch ``tag``'s activation header from ``src`` now (no-op if not
        :attr:`preposting` or already posted); :meth:`recv` picks it up."""
        key = (src, 3 * tag)
        if self.preposting and key not in self._recvs:
            h = torch.empty(2 + _MAX_NDIM, dtype=torch.int64, device=self.device)
            self._recvs[key] = (guarded_post(lambda: dist.irecv(h, src, tag=3 * tag), "pipeline receive"), h)

    def prepost_like(self, ref: Tensor, src: int, tag: int) -> None:
        """Post the receive of micro-batch ``tag``'s gradient (shaped like ``ref``) from ``src`` now (no-op if not
        :attr:`preposting` or already posted); :meth:`recv_like` picks it up."""
        key = (src, 3 * tag + 2)
        if self.preposting and key not in self._recvs:
            t = torch.empty(ref.shape, dtype=ref.dtype, device=self.device)
            self._recvs[key] = (guarded_post(lambda: dist.irecv(t, src, tag=3 * tag + 2),
                                             "pipeline gradient receive"), t)

    def _take(self, src: int, tag: int, what: str) -> Optional[Tensor]:
        posted = self._recvs.pop((src, tag), None)
        if posted is None:
            return None
        work, buf = posted
        guarded_wait(work, what)
        return buf

    def recv(self, src: int, tag: int) -> Tensor:
        """Receive a tensor with header from global rank ``src`` (blocking)."""
        h = self._take(src, 3 * tag, "pipeline receive")
        if h is None:
            h = torch.empty(2 + _MAX_NDIM, dtype=torch.int64, device=self.device)
            guarded(lambda: dist.irecv(h, src, tag=3 * tag), "pipeline receive")
        shape, dtype = self._parse(h)
        t = torch.empty(shape, dtype=dtype, device=self.device)
        guarded(lambda: dist.irecv(t, src, tag=3 * tag + 1), "pipeline receive")
        return t

    def recv_like(self, ref: Tensor, src: int, tag: int) -> Tensor:
        """Receive a tensor shaped like ``ref`` (a gradient) from global rank ``src`` (blocking)."""
        t = self._take(src, 3 * tag + 2, "pipeline gradient receive")
        if t is not None:
            return t
        t = torch.empty(ref.shape, dtype=ref.dtype, device=self.device)
        guarded(lambda: dist.irecv(t, src, tag=3 * tag + 2), "pipeline gradient receive")
        return t

    def wait_all(self) -> None:
        """Wait for every posted send (and every pre-posted receive, which a finished step has none of)."""
        for chan in self._sends.values():
            while chan:
                self._wait_one(chan)
        self._sends.clear()
        recvs, self._recvs = self._recvs, {}
        for work, _ in recvs.values():
            guarded_wait(work, "pipeline receive")

    def abandon(self) -> None:
        """Give up every outstanding operation of a step that failed: never waited or reused again, and never
        destroyed while it may still be pending (parked with the active liveness, else kept here)."""
        works = [w for chan in self._sends.values() for _, ws in chan for w in ws]
        works += [w for w, _ in self._recvs.values()]
        self._sends.clear()
        self._recvs.clear()
        live = active()
        for work in works:
            if live is not None:
                live.park(work)
            else:
                self._abandoned.append(work)

    def broadcast(self, t: Optional[Tensor], src: int) -> Tensor:
        """Broadcast a tensor of unknown shape from global rank ``src`` over the pipeline group."""
        h = self._header(t) if t is not None and dist.get_rank() == src else torch.empty(
            2 + _MAX_NDIM, dtype=torch.int64, device=self.device
        )
        guarded(lambda: dist.broadcast(h, src, group=self.group, async_op=True), "pipeline broadcast", collective=True)
        shape, dtype = self._parse(h)
        if dist.get_rank() == src:
            assert t is not None
            data = t.detach().contiguous()
        else:
            data = torch.empty(shape, dtype=dtype, device=self.device)
        guarded(lambda: dist.broadcast(data, src, group=self.group, async_op=True), "pipeline broadcast",
                collective=True)
        return data


# ---------------------------------------------------------------------------------------------------- executors
def run_train_schedule(
    ops: Sequence[Op],
    micro: Sequence[Any],
    stage_module: nn.Module,
    p2p: P2P,
    prev_rank: Optional[int],
    next_rank: Optional[int],
    head: Callable[[Any], Tensor],
    tail: Callable[[Any, Optional[Tensor]], Tensor],
    loss_scale: float,
    forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    middle: Optional[Callable[[Any, Tensor], Tensor]] = None,
) -> list[Tensor]:
    """Run one stage's forward/backward operations for one training step.

    Gradients accumulate into the stage's parameters (``.grad``). The caller owns the data-parallel all-reduce.
    What a micro-batch holds (its received activation, its output and graph, its outgoing messages) is released as
    soon as its backward is done and the peer is known to have it (see the module docstring), so under 1F1B a stage
    holds what the schedule keeps in flight, independently of M.

    Args:
        ops: from :func:`schedule_ops`.
        micro: the M micro-batches (all stages of a pipeline hold the same batch).
        stage_module: the local stage (used on middle stages).
        p2p: transport.
        prev_rank: global rank of the previous stage, ``None`` on stage 0.
        next_rank: global rank of the next stage, ``None`` on the last stage.
        head: ``head(micro_batch) -> output`` on stage 0 of a deeper pipeline (runs the user's step up to the
            stack; the output keeps its autograd graph).
        tail: ``tail(micro_batch, activation) -> loss`` on the last stage (the user's step with the local stage
            fed by ``activation``; ``activation`` is ``None`` when P = 1).
        loss_scale: factor applied to each micro-batch loss before backward (``1 / (M * accumulation)``).
        forward_context: context manager factory wrapping every forward (autocast).
        middle: ``middle(micro_batch, activation) -> output`` on middle stages (default: ``stage_module(act)``;
            block lists run the user's step so that blocks get their extra arguments).

    Returns:
        The (unscaled, detached) micro-batch losses on the last stage; empty elsewhere.

    Raises:
        PeerLostError: a neighbour was lost (from the wait that noticed it); the step's outstanding transfers are
            abandoned (:meth:`P2P.abandon`).
    """
    try:
        return _train_schedule(ops, micro, stage_module, p2p, prev_rank, next_rank, head, tail, loss_scale,
                               forward_context, middle)
    except BaseException:
        p2p.abandon()
        raise


def _train_schedule(
    ops: Sequence[Op], micro: Sequence[Any], stage_module: nn.Module, p2p: P2P, prev_rank: Optional[int],
    next_rank: Optional[int], head: Callable[[Any], Tensor], tail: Callable[[Any, Optional[Tensor]], Tensor],
    loss_scale: float, forward_context: Callable[[], AbstractContextManager[Any]],
    middle: Optional[Callable[[Any, Tensor], Tensor]],
) -> list[Tensor]:
    first, last = prev_rank is None, next_rank is None
    saved: dict[int, tuple[Optional[Tensor], Tensor]] = {}
    losses: list[Tensor] = []
    forwards = [m for kind, m in ops if kind == "F"]
    backwards = [m for kind, m in ops if kind == "B"]
    done_f = done_b = 0
    if not first and forwards:
        p2p.prepost_header(prev_rank, forwards[0])  # type: ignore[arg-type]
    for kind, m in ops:
        if kind == "F":
            act: Optional[Tensor] = None
            with forward_context():
                if not first:
                    act = p2p.recv(prev_rank, m)  # type: ignore[arg-type]
                    if done_f + 1 < len(forwards):  # the next activation's header moves while this one computes
                        p2p.prepost_header(prev_rank, forwards[done_f + 1])  # type: ignore[arg-type]
                    if act.is_floating_point():
                        act.requires_grad_(True)
                if last:
                    out = tail(micro[m], act)
                    losses.append(out.detach())
                elif first:
                    out = head(micro[m])
                elif middle is not None:
                    out = middle(micro[m], act)  # type: ignore[arg-type]
                else:
                    out = stage_module(act)
            if not last:
                p2p.send(out, next_rank, m)  # type: ignore[arg-type]  # waited when its gradient comes back
            saved[m] = (act, out)
            done_f += 1
        else:
            act, out = saved.pop(m)
            if last:
                if out.requires_grad:
                    torch.autograd.backward(out * loss_scale)
            elif out.is_floating_point():
                grad = p2p.recv_like(out, next_rank, m)  # type: ignore[arg-type]
                p2p.release(next_rank, m)  # type: ignore[arg-type]  # the next stage has activations <= m
                if out.requires_grad:
                    torch.autograd.backward(out, grad)
                del grad
            if not first and act is not None and act.is_floating_point():
                g = act.grad if act.grad is not None else torch.zeros_like(act)
                p2p.send(g, prev_rank, m, with_header=False, window=SEND_WINDOW)  # type: ignore[arg-type]
                del g
            done_b += 1
        del act, out  # nothing of a finished micro-batch outlives its backward here
        if not last:  # the gradients of the next backwards move while this stage computes
            for n in backwards[done_b:done_b + PREPOST_GRADIENTS]:
                if n in saved and saved[n][1].is_floating_point():
                    p2p.prepost_like(saved[n][1], next_rank, n)  # type: ignore[arg-type]
    p2p.wait_all()
    return losses


def run_forward_only(
    micro: Sequence[Any],
    stage_module: nn.Module,
    p2p: P2P,
    prev_rank: Optional[int],
    next_rank: Optional[int],
    head: Callable[[Any], Tensor],
    middle: Optional[Callable[[Any, Tensor], Tensor]] = None,
    tail: Optional[Callable[[Any, Tensor], Tensor]] = None,
) -> list[Tensor]:
    """Push micro-batches forward through one stage (evaluation); returns the stack outputs on the last stage.

    At most :data:`SEND_WINDOW` sent activations stay outstanding (data flows one way, so waiting the oldest cannot
    deadlock); the next activation's header is pre-posted while a micro-batch computes.

    Args:
        micro: micro-batches (same on every stage of the pipeline).
        stage_module: the local stage.
        p2p: transport.
        prev_rank: previous stage's global rank or ``None``.
        next_rank: next stage's global rank or ``None``.
        head: ``head(micro_batch) -> output`` on stage 0 (the user's step up to the stack).
        middle: ``middle(micro_batch, activation) -> output`` on middle stages (default ``stage_module``).
        tail: ``tail(micro_batch, activation) -> output`` on the last stage (default ``stage_module``).

    Returns:
        The last stage's outputs, one per micro-batch (empty list on other stages).

    Raises:
        PeerLostError: a neighbour was lost; the outstanding transfers are abandoned (:meth:`P2P.abandon`).
    """
    first, last = prev_rank is None, next_rank is None
    outs: list[Tensor] = []
    try:
        for m, mb in enumerate(micro):
            if first:
                x = head(mb)
            else:
                act = p2p.recv(prev_rank, m)  # type: ignore[arg-type]
                if m + 1 < len(micro):
                    p2p.prepost_header(prev_rank, m + 1)  # type: ignore[arg-type]
                fn = tail if last else middle
                x = fn(mb, act) if fn is not None else stage_module(act)
                del act
            if last:
                outs.append(x)
            else:
                p2p.send(x, next_rank, m, window=SEND_WINDOW)  # type: ignore[arg-type]
            del x
        p2p.wait_all()
    except BaseException:
        p2p.abandon()
        raise
    return outs
