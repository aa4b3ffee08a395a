"""Process groups of one generation: who is which (replica, stage), and the groups they talk in.

Problem: a D x P job needs, besides the world group, one *pipeline group* per replica (the P stages that pass
activations to each other) and one *data group* per stage (the D copies of a stage that average gradients). When the
shape changes (a later issue: live reconfiguration) all of them must be torn down and rebuilt in place, and a group
of the new generation must never connect to addresses left over from the old one. So every generation ``g``
initializes the world from the store scope ``gen/<g>`` (:func:`~lightning_parcae.runtime.store.scoped`: keys
``gen/<g>/...``) and derives its subgroups from it; destroying and rebuilding with ``g + 1`` is the whole
reconfiguration protocol at this level. Once every rank of generation ``g`` is connected, its rank 0 deletes the
scopes of older generations (:func:`retire_scopes`), so an etcd store holds the rendezvous keys of at most the
current and the next generation, not of every generation since the job began.

Rank layout: ``rank = replica * P + stage`` -- the stages of one pipeline are contiguous ranks, so replica 0 holds
ranks ``0 .. P-1`` and global rank 0 is stage 0 of replica 0.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from lightning_parcae.errors import ConfigurationError, PeerLostError, RendezvousError
from lightning_parcae.runtime.lifecycle import exit_now, script_failed, track_script_failure
from lightning_parcae.runtime.store import drop_scopes, scoped
from lightning_parcae.runtime.torch_internals import forget_process_groups, set_group_timeout

__all__ = ["Coords", "ProcessGroups", "await_arrivals", "await_connected", "connect_timeout", "coords_of",
           "device_backends", "init_transition_world", "rank_of", "retire_scopes", "shut_down_groups_at_exit",
           "GLOO_CONNECT_FACTOR", "EXIT_SHUTDOWN_S"]

GLOO_CONNECT_FACTOR = 5
"""gloo waits this many times a group's timeout for the first connection of each pair (``tcp::Pair::waitUntil``:
"use a longer timeout when waiting for initial connect"), once the peer's address is in the store."""

_log = logging.getLogger(__name__)

EXIT_SHUTDOWN_S = 30.0
"""How long :func:`shut_down_groups_at_exit` lets the process groups' shutdown take at interpreter exit before it
ends the process without it."""

ARRIVAL_WATCH_S = 0.2
"""Longest single watch of :func:`await_arrivals` on a store that watches: the abort is checked between them."""

Aborted = Callable[[], Optional[str]]
"""Returns why the generation being built was aborted (a peer declared dead), or None while it is not."""


@dataclass(frozen=True)
class Coords:
    """Where a rank sits in a D x P grid.

    Attributes:
        replica: index of the pipeline (data-parallel index), ``0 <= replica < D``.
        stage: pipeline stage, ``0 <= stage < P``.
    """

    replica: int
    stage: int


def _check_shape(world: int, data_parallel: int, pipeline_stages: int) -> None:
    if data_parallel < 1 or pipeline_stages < 1 or data_parallel * pipeline_stages != world:
        raise ConfigurationError(
            f"shape D={data_parallel} x P={pipeline_stages} does not cover the world of {world} processes; "
            "D * P must equal the number of processes"
        )


def coords_of(rank: int, pipeline_stages: int) -> Coords:
    """Map a global rank to its (replica, stage).

    Args:
        rank: global rank.
        pipeline_stages: P.

    Returns:
        The rank's coordinates.
    """
    return Coords(replica=rank // pipeline_stages, stage=rank % pipeline_stages)


def rank_of(replica: int, stage: int, pipeline_stages: int) -> int:
    """Map (replica, stage) to a global rank (inverse of :func:`coords_of`)."""
    return replica * pipeline_stages + stage


def device_backends(backend: str) -> str:
    """The backend string a generation's groups are built with: ``"nccl"`` becomes ``"cpu:gloo,cuda:nccl"``.

    The runtime's own traffic -- the step agreement, commit votes, layer payloads in a migration -- is small CPU
    tensors; the training traffic (gradients, activations) is on the GPU. A pure NCCL group refuses CPU tensors
    ("No backend type associated with device type cpu"): on the first GPU run every step's agreement failed and
    became a recovery. Each device type gets its backend instead.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def connect_timeout(bound: timedelta) -> timedelta:
    """The gloo timeout to build groups with so that building them fails within ``bound``.

    Regression (chaos seed 64, under load): a member was SIGKILLed while the survivors built a recovery generation's
    groups, after it had published its address and connected to one survivor only. That survivor got through; the
    other three waited in ``connectFullMesh`` for their connection to the dead member -- which gloo bounds by
    ``GLOO_CONNECT_FACTOR`` (5) times the group timeout, i.e. 75 s for the 15 s watchdog -- with no timeout firing
    until the launcher killed them 43 s later. Building with ``bound / 5`` (and raising the groups' operation
    timeout back to ``bound`` once they are built) keeps every wait of the build within ``bound``.
    """
    return bound / GLOO_CONNECT_FACTOR


def await_arrivals(store: dist.Store, rank: int, world: int, bound: timedelta, aborted: Optional[Aborted] = None,
                   what: str = "rendezvous", poll_s: float = 0.02, key: str = "arrived") -> None:
    """Every rank of a rendezvous records its arrival under ``store`` and waits until all ``world`` have arrived.

    Members reach the build of a new generation at different times (one still receives its layers while another
    is done). The gloo rendezvous that follows is built with :func:`connect_timeout` -- a fifth of the bound -- so
    the arrival skew is absorbed here instead, within the full bound, and abortably: a member declared dead by the
    heartbeats ends the wait at once.

    Args:
        store: The rendezvous's (prefixed) store.
        rank: This process's rank in the rendezvous.
        world: Number of ranks.
        bound: The longest wait (the progress watchdog's bound; the start-up timeout for generation 0).
        aborted: Polled while waiting; a reason ends the wait.
        what: Label for errors.
        poll_s: Polling period.
        key: Name of the arrival keys (``<key>/<rank>``); one rendezvous may hold several barriers.

    Raises:
        PeerLostError: ``aborted`` gave a reason.
        RendezvousError: Some rank did not arrive within ``bound`` (the message names them).

    Regression (issue 21): each poll checked the ``world`` keys one by one, so every waiting rank sent ``world``
    requests per 20 ms -- at N = 32, 32 members x 32 checks: ~51,000 store requests a second while a generation
    formed, on the store every heartbeat also goes through. Now one ``check`` of all keys per poll (one request on a
    ``TCPStore``, one directory read of the generation's scope on etcd); the per-rank checks only name the missing
    ranks in an error. On a store that watches (etcd: ``wait_for_all`` on the rendezvous's scope) a waiting rank
    sleeps in a watch that the next arrival ends, in slices of at most :data:`ARRIVAL_WATCH_S` (the abort and the
    deadline are checked between them): two requests per arrival instead of one every ``poll_s``.
    """
    store.set(f"{key}/{rank}", "1")
    keys = [f"{key}/{r}" for r in range(world)]
    deadline = time.monotonic() + bound.total_seconds()
    wait_all = getattr(store, "wait_for_all", None)

    def missing() -> list[int]:  # per rank: only to name them in an error
        return [r for r, k in enumerate(keys) if not store.check([k])]

    while True:
        if wait_all is not None:
            if wait_all(keys, max(0.0, min(ARRIVAL_WATCH_S, deadline - time.monotonic()))):
                return
        elif store.check(keys):
            return
        reason = aborted() if aborted is not None else None
        if reason:
            # the abort is the generation's shared decision: a rank that finds every peer arrived a moment after
            # a peer gave up must give up too, or the job splits -- only the message differs
            late = missing()
            raise PeerLostError(f"{what} abandoned while ranks {late} had not arrived: {reason}" if late else
                                f"{what} abandoned after every rank had arrived: the generation was aborted "
                                f"({reason})")
        if time.monotonic() >= deadline:
            raise RendezvousError(f"{what}: ranks {missing()} of {world} did not arrive within "
                                  f"{bound.total_seconds():g} s")
        if wait_all is None:
            time.sleep(poll_s)


def await_connected(store: dist.Store, rank: int, world: int, bound: timedelta, aborted: Optional[Aborted] = None,
                    what: str = "rendezvous") -> None:
    """Return only once every rank's gloo groups of this rendezvous are connected on *its* side too.

    Regression (chaos test ``test_parcae_run_survives_a_kill_from_outside...``: 2 of 13 runs on 2 loaded cores;
    issue 9's "seed 14" and "seed 26"): gloo's ``connectFullMesh`` can return on one rank while its peer is still
    completing its side of their pair. In a recovery nothing has to move (D = 2 -> 2, every survivor holds the whole
    model), so a survivor built the transition world, had nothing to send, and destroyed it at once; the other
    survivor's connect then failed with "Connection closed by peer", the generation could not be entered and the
    job fell back to the checkpoint (~10 s lost instead of a 3 s recovery in place). Two bare processes doing
    ``init`` then ``destroy`` on 2 loaded cores failed so in 5 of 5 runs of 1000 rounds, with this barrier between
    the two in 0 of 5 (``benchmarks/gloo_teardown_race.py``). It is a store barrier, abortable and bounded like
    :func:`await_arrivals`.
    """
    await_arrivals(store, rank, world, bound, aborted, what=f"{what} (connections)", key="connected")


def retire_scopes(store: dist.Store, generation: int) -> list[str]:
    """Delete the rendezvous scopes (``gen/<h>``, ``mig/<h>``) and commit tallies (``commit/<h>/<step>``: a step
    cut short by a failure keeps its own) of every generation ``h`` before ``generation``.

    Called by rank 0 of ``generation`` once all its ranks are connected: every member of it has destroyed the
    older generations' groups by then (a rank builds a generation only with torch.distributed torn down), and a
    member left behind in an older one has left the job. What a store cannot list (all but etcd) is left as is.
    A store that fails here costs nothing but the cleanup: the error is logged, never raised.

    Args:
        store: The job's base store.
        generation: The generation now connected.

    Returns:
        The scopes deleted.
    """
    def older(name: str) -> bool:
        kind, _, rest = name.partition("/")
        number = rest.split("/", 1)[0]  # commit tallies are "commit/<g>/<step>"
        return kind in ("gen", "mig", "commit") and number.isdigit() and int(number) < generation

    try:
        return drop_scopes(store, older)
    except Exception as exc:  # noqa: BLE001 -- a store hiccup must not fail a generation that is built
        _log.warning("could not delete the rendezvous keys of generations before %d: %s", generation, exc)
        return []


def init_transition_world(store: dist.Store, generation: int, rank: int, world: int, bound: timedelta,
                          aborted: Optional[Aborted] = None) -> None:
    """Initialize generation ``generation``'s transition world (every process that sends or receives state).

    The participants first wait for each other abortably (:func:`await_arrivals`), then connect with a fifth of
    ``bound`` (:func:`connect_timeout`: a participant lost in between made the others wait 75 s, chaos seed 64),
    then wait until every participant is connected (:func:`await_connected`: one with nothing to transfer must not
    tear the world down while a peer still connects). The transfers then run with the full ``bound``.

    Args:
        store: The job's base store; the world uses the prefix ``mig/<generation>/``.
        generation: The generation being entered.
        rank: This process's index in the transition list.
        world: Number of participants.
        bound: The progress watchdog's bound.
        aborted: Polled while waiting (a participant declared dead ends the wait).

    Raises:
        PeerLostError: ``aborted`` gave a reason while waiting.
        RendezvousError: A participant did not arrive or connect within ``bound``.
        RuntimeError: gloo's rendezvous failed.
    """
    what = f"transition world of generation {generation}"
    prefixed = scoped(store, f"mig/{generation}")
    await_arrivals(prefixed, rank, world, bound, aborted, what=what)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world, timeout=connect_timeout(bound))
    set_group_timeout(bound, None)
    await_connected(prefixed, rank, world, bound, aborted, what=what)


class ProcessGroups:
    """The world and its pipeline / data subgroups for one generation.

    Args:
        generation: generation number; the world is initialized under the store prefix ``gen/<generation>/``.
        rank: this process's global rank in this generation.
        world: number of processes.
        data_parallel: D.
        pipeline_stages: P.
        store: the base store shared by all processes (e.g. a ``TCPStore``); it outlives generations.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        timeout: collective timeout, and the bound of :meth:`build` (arrivals, then connections).
        aborted: Polled while waiting for the other ranks to arrive (see :func:`await_arrivals`).

    Raises:
        ConfigurationError: if ``D * P != world``.
    """

    def __init__(
        self,
        generation: int,
        rank: int,
        world: int,
        data_parallel: int,
        pipeline_stages: int,
        store: dist.Store,
        backend: str = "gloo",
        timeout: timedelta = timedelta(minutes=30),
        aborted: Optional[Aborted] = None,
    ) -> None:
        _check_shape(world, data_parallel, pipeline_stages)
        self.generation = generation
        self.rank = rank
        self.world = world
        self.data_parallel = data_parallel
        self.pipeline_stages = pipeline_stages
        self.store = store
        self.backend = backend
        self.timeout = timeout
        self.aborted = aborted
        self.coords = coords_of(rank, pipeline_stages)
        self._pipeline_groups: list[Any] = []
        self._data_groups: list[Any] = []
        self._built = False

    # ------------------------------------------------------------------ layout (pure)
    def pipeline_ranks(self, replica: int) -> list[int]:
        """Global ranks of the P stages of ``replica``, in stage order."""
        return [rank_of(replica, s, self.pipeline_stages) for s in range(self.pipeline_stages)]

    def data_ranks(self, stage: int) -> list[int]:
        """Global ranks holding ``stage``, one per replica, in replica order."""
        return [rank_of(r, stage, self.pipeline_stages) for r in range(self.data_parallel)]

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank runs stage 0."""
        return self.coords.stage == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs stage P-1."""
        return self.coords.stage == self.pipeline_stages - 1

    def prev_rank(self) -> Optional[int]:
        """Global rank of the previous stage in this pipeline (``None`` on stage 0)."""
        if self.is_first_stage:
            return None
        return rank_of(self.coords.replica, self.coords.stage - 1, self.pipeline_stages)

    def next_rank(self) -> Optional[int]:
        """Global rank of the next stage in this pipeline (``None`` on the last stage)."""
        if self.is_last_stage:
            return None
        return rank_of(self.coords.replica, self.coords.stage + 1, self.pipeline_stages)

    def last_stage_rank(self) -> int:
        """Global rank of this pipeline's last stage."""
        return rank_of(self.coords.replica, self.pipeline_stages - 1, self.pipeline_stages)

    # ------------------------------------------------------------------ lifecycle
    def build(self) -> "ProcessGroups":
        """Initialize the world under ``gen/<generation>/`` and create all subgroups (collective: all ranks call).

        Every wait is bounded by ``timeout``: the ranks first meet in :func:`await_arrivals` (abortable), then
        connect with :func:`connect_timeout` (gloo waits 5x its timeout for a pair's first connection), wait until
        every rank is connected (:func:`await_connected`), and the groups' operations get ``timeout`` back.

        Returns:
            ``self``, for chaining.

        Raises:
            PeerLostError: ``aborted`` reported a reason while waiting for the other ranks.
            RendezvousError: A rank did not arrive within ``timeout``.
            RuntimeError: gloo's rendezvous failed (a rank arrived, then vanished before connecting).
        """
        if dist.is_initialized():
            raise ConfigurationError(
                "torch.distributed is already initialized; destroy the previous generation before building "
                f"generation {self.generation}"
            )
        prefixed = scoped(self.store, f"gen/{self.generation}")
        await_arrivals(prefixed, self.rank, self.world, self.timeout, self.aborted,
                       what=f"process groups of generation {self.generation}")
        connect = connect_timeout(self.timeout)
        dist.init_process_group(
            backend=device_backends(self.backend), store=prefixed, rank=self.rank, world_size=self.world, timeout=connect
        )
        # new_group is collective over the world: every rank creates every group in the same order.
        self._pipeline_groups = [dist.new_group(self.pipeline_ranks(r), timeout=connect)
                                 for r in range(self.data_parallel)]
        self._data_groups = [dist.new_group(self.data_ranks(s), timeout=connect)
                             for s in range(self.pipeline_stages)]
        await_connected(prefixed, self.rank, self.world, self.timeout, self.aborted,
                        what=f"process groups of generation {self.generation}")
        self._built = True
        shut_down_groups_at_exit()
        if self.rank == 0:
            retire_scopes(self.store, self.generation)
        self.set_op_timeout(self.timeout)
        return self

    def set_op_timeout(self, timeout: timedelta) -> None:
        """Bound every later operation of this generation's groups (this rank's world, pipeline and data groups).

        The progress watchdog of live reconfiguration: generation 0 is built with a long rendezvous timeout (the
        processes start at different times), then its operations get the short stall bound, so a collective that
        makes no progress fails within ``timeout`` -- and becomes a recovery -- instead of blocking for gloo's
        group timeout.
        """
        if not self._built or "gloo" not in device_backends(self.backend):
            return
        self.timeout = timeout
        for group in (None, self.pipeline_group, self.data_group):
            set_group_timeout(timeout, group)

    def destroy(self) -> None:
        """Destroy every group of this generation (the base store survives)."""
        if self._built and dist.is_initialized():
            dist.destroy_process_group()
        self._pipeline_groups = []
        self._data_groups = []
        self._built = False

    def abandon(self) -> list[Any]:
        """Forget this generation *without* shutting its groups down (after a failure); returns them to park.

        ``destroy_process_group`` shuts every backend down, and a gloo backend with an operation stuck on a dead
        peer blocks that shutdown until the operation's timeout. After a failure the survivors instead drop the
        generation from torch's registry (so the next generation can initialize) and keep the old group objects
        referenced forever (their destructor would block the same way). This uses torch's private registry, the
        same steps ``destroy_process_group`` takes after its shutdown calls (:mod:`.torch_internals`).
        """
        kept: list[Any] = list(self._pipeline_groups) + list(self._data_groups)
        if dist.is_initialized():
            kept.extend(forget_process_groups())
        self._pipeline_groups = []
        self._data_groups = []
        self._built = False
        return kept

    def rebuilt(self, data_parallel: int, pipeline_stages: int, rank: Optional[int] = None,
                world: Optional[int] = None) -> "ProcessGroups":
        """Destroy this generation and build generation ``g + 1`` with a new shape (collective).

        Args:
            data_parallel: new D.
            pipeline_stages: new P.
            rank: this process's rank in the new generation (default: unchanged).
            world: new world size (default: unchanged).

        Returns:
            The new, built :class:`ProcessGroups`.
        """
        self.destroy()
        nxt = ProcessGroups(
            self.generation + 1,
            self.rank if rank is None else rank,
            self.world if world is None else world,
            data_parallel,
            pipeline_stages,
            self.store,
            self.backend,
            self.timeout,
            self.aborted,
        )
        return nxt.build()

    @property
    def built(self) -> bool:
        """Whether :meth:`build` ran and :meth:`destroy` did not."""
        return self._built

    # ------------------------------------------------------------------ groups of this rank
    @property
    def pipeline_group(self) -> Any:
        """The pipeline group of this rank's replica."""
        return self._pipeline_groups[self.coords.replica]

    @property
    def data_group(self) -> Any:
        """The data-parallel group of this rank's stage."""
        return self._data_groups[self.coords.stage]

    def pipeline_group_of(self, replica: int) -> Any:
        """The pipeline group of ``replica``."""
        return self._pipeline_groups[replica]


_AT_EXIT: list[bool] = []


def shut_down_groups_at_exit() -> None:
    """Destroy whatever process groups are still up when the script ends, while the interpreter is still whole.

    Regression (a static 1 x 2 pipeline, about 1 run in 40 here; seen in two tests of the full suite): the strategy
    keeps a generation's groups up after ``fit``, as Lightning's DDP does, so ``trainer.save_checkpoint`` and later
    Trainer stages work. Left to interpreter finalization, gloo's threads and the work objects they hold were torn
    down with the interpreter half gone, and a rank that had finished its work aborted ("terminate called without an
    active exception", exit status -6) -- the failure torch reports when ``destroy_process_group`` is never called
    (pytorch/pytorch#190489). Registered once per process when its first generation is built; ``atexit`` runs it
    after non-daemon threads (a background checkpoint write) have finished. Destroying a group whose peer died could
    block, so the shutdown gets :data:`EXIT_SHUTDOWN_S`; past that the process ends at once, with status 1 if an
    exception ended the script, else 0. A process that left a generation after a failure has already arranged to
    exit without destructors (:func:`~lightning_parcae.runtime.lifecycle.exit_without_destructors_at_shutdown`,
    registered later, so it runs first).
    """
    if _AT_EXIT:
        return
    _AT_EXIT.append(True)
    track_script_failure()
    atexit.register(_shut_down, EXIT_SHUTDOWN_S)


def _destroy_all() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 -- at exit: say it, do not replace the script's outcome
        _log.warning("process groups' shutdown at exit failed: %s", exc)


def _shut_down(bound_s: float) -> None:
    """The ``atexit`` handler of :func:`shut_down_groups_at_exit`."""
    if not dist.is_initialized():
        return
    try:
        worker = threading.Thread(target=_destroy_all, name="parcae-exit-shutdown", daemon=True)
        worker.start()
    except RuntimeError:  # a Python that refuses new threads at shutdown: a C-level watchdog bounds it instead
        faulthandler.dump_traceback_later(bound_s, exit=True)
        _destroy_all()
        faulthandler.cancel_dump_traceback_later()
        return
    worker.join(bound_s)
    if worker.is_alive():
        _log.warning("process groups' shutdown at exit took over %.0f s (a peer gone?); exiting without it", bound_s)
        exit_now(1 if script_failed() else 0)
