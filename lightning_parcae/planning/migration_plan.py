"""Which member takes which slot after a change of shape, and which layers move from whom to whom.

Problem: a D x P job (D data-parallel replicas of a P-stage pipeline) runs on processes named by string member
ids; ``members[replica * P + stage]`` holds the layers of ``stage``. When instances leave (notice or sudden loss),
join, or the optimizer picks another shape, the runtime must decide which of the available members fills each
``(replica, stage)`` slot of the new layout, and which layers (parameters + optimizer state) each of them must
receive from which live holder. Moving bytes is what costs time, so the slots are filled to move as few bytes as
possible: a member that already holds a layer keeps it, everything else is copied from a member that still holds
it. If every holder of a needed layer is gone the state cannot be rebuilt from live peers and the job must fall
back to its last checkpoint (:class:`StageLostError`).

How: a candidate's cost for a stage-``s`` slot is the bytes of the layers of ``s`` it does not hold. The slots are
filled by a minimum-cost assignment (``scipy.optimize.linear_sum_assignment``; extra candidates become warm
standbys), solved *lexicographically* so ties are broken exactly and deterministically, never by float epsilons:

1. fewest needed layers that no sender holds (so :class:`StageLostError` is raised only when unavoidable),
2. fewest bytes moved,
3. fewest layers moved (decides among zero-byte layers),
4. survivors (members of the old layout) before joiners,
5. survivors keeping their old stage, then their old replica index,
6. earlier members of ``available``, and earlier members in lower ranks.

Transfers run in parallel, so a migration's time grows with the most one process sends or receives (the plan's
peak), not with the bytes moved in all. Where some assignment gives the busiest receiver fewer bytes, the planner
also solves with that bound as phase 2 (before the bytes moved) and keeps whichever plan has the lower peak --
more bytes in all can load the senders more (stop 50: 3x9 -> 4x7 of the emulated GPT-1.5B gave one member 610 kB
to receive where nobody need receive more than 457 kB).

Each phase keeps only the edges that are tight under an optimal dual of the previous phase, so the next phase
chooses among exactly the previous phase's optimal assignments. Every source of a transfer is then picked to keep
the busiest sender's bytes low -- what a member receives is fixed by its slot, what it sends is not, and transfers
run in parallel, so the most one process sends or receives is what a migration's time grows with: the most
constrained transfers first, each from the eligible sender with the fewest bytes so far, then transfers moved off
the busiest sender while another holder can take one and stay below it.

Plain Python + numpy + scipy; no torch. The runtime executes a :class:`MigrationPlan`; it never plans.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from lightning_parcae.planning.kinds import MigrationKind
from lightning_parcae.errors import ConfigurationError, ParcaeError

__all__ = ["Layout", "Transfer", "MigrationPlan", "StageLostError", "plan_migration"]

_EXACT = 2**52
"""Integer magnitudes below this are exact in float64 (the assignment solver works in float64)."""


class StageLostError(ParcaeError, RuntimeError):
    """Every holder of some needed layer is gone: the state cannot be rebuilt from live peers.

    Attributes:
        layers: The needed layers that no sender holds.
        stages: The old stages whose every replica is gone.
    """

    def __init__(self, message: str, layers: Sequence[int] = (), stages: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.layers: tuple[int, ...] = tuple(layers)
        self.stages: tuple[int, ...] = tuple(stages)


# ----------------------------------------------------------------------------------------------------------------
# layout


def _check_members(members: Sequence[Any], what: str) -> tuple[str, ...]:
    out = tuple(members)
    bad = [m for m in out if not isinstance(m, str) or not m]
    if bad:
        raise ConfigurationError(f"{what} must be non-empty strings (member ids); got {bad!r}")
    dups = sorted(m for m, k in Counter(out).items() if k > 1)
    if dups:
        raise ConfigurationError(
            f"{what} name {', '.join(map(repr, dups))} more than once: every member id must be unique"
        )
    return out


def _check_partition(partition: Sequence[Any], what: str) -> tuple[int, ...]:
    out = tuple(partition)
    if not out:
        raise ConfigurationError(f"{what} is empty: give the number of layers of each stage (at least one stage)")
    if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1 for x in out):
        raise ConfigurationError(
            f"{what} {list(out)} is invalid: every stage must hold a positive whole number of layers"
        )
    return tuple(int(x) for x in out)


@dataclass(frozen=True)
class Layout:
    """Who holds what in a D x P job.

    ``members[rank]`` sits at replica ``rank // P`` and stage ``rank % P``; stage ``s`` holds the layers
    ``[sum(partition[:s]), sum(partition[:s + 1]))``.

    Attributes:
        members: Member ids in rank order (D * P of them, no duplicates).
        partition: Layers per stage (P positive ints).

    Raises:
        ConfigurationError: If the partition is empty or not positive, the member count is not a positive multiple
            of P, or a member id repeats.
    """

    members: tuple[str, ...]
    partition: tuple[int, ...]

    def __post_init__(self) -> None:
        partition = _check_partition(self.partition, "the layout's partition")
        members = _check_members(self.members, "the layout's members")
        p = len(partition)
        if not members or len(members) % p:
            raise ConfigurationError(
                f"a layout of {len(members)} members cannot fill {p} pipeline stages: the member count must be a "
                f"positive multiple of P={p} (D replicas x P stages, in rank order replica * P + stage)"
            )
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "partition", partition)
        object.__setattr__(self, "_rank", {m: r for r, m in enumerate(members)})
        object.__setattr__(self, "_starts", tuple(int(x) for x in np.concatenate(([0], np.cumsum(partition)))))

    @property
    def data_parallel(self) -> int:
        """D, the number of pipeline replicas."""
        return len(self.members) // len(self.partition)

    @property
    def pipeline_stages(self) -> int:
        """P, the number of stages per pipeline."""
        return len(self.partition)

    @property
    def num_layers(self) -> int:
        """L, the number of layers of the model."""
        return self._starts[-1]  # type: ignore[attr-defined]

    def rank_of(self, member: str) -> int | None:
        """The member's rank (``replica * P + stage``), or None if it is not in this layout."""
        return self._rank.get(member)  # type: ignore[attr-defined]

    def stage_of(self, member: str) -> int | None:
        """The member's stage, or None if it is not in this layout."""
        rank = self.rank_of(member)
        return None if rank is None else rank % self.pipeline_stages

    def replica_of(self, member: str) -> int | None:
        """The member's replica index, or None if it is not in this layout."""
        rank = self.rank_of(member)
        return None if rank is None else rank // self.pipeline_stages

    def stage_layers(self, stage: int) -> range:
        """The layers held by ``stage``.

        Raises:
            ConfigurationError: If ``stage`` is not in ``[0, P)``.
        """
        if not 0 <= stage < self.pipeline_stages:
            raise ConfigurationError(
                f"stage {stage} does not exist: this layout has stages 0..{self.pipeline_stages - 1}"
            )
        return range(self._starts[stage], self._starts[stage + 1])  # type: ignore[attr-defined]

    def layers_of(self, member: str) -> range:
        """The layers the member holds (an empty range if it is not in this layout)."""
        stage = self.stage_of(member)
        return range(0) if stage is None else self.stage_layers(stage)

    def stage_of_layer(self, layer: int) -> int:
        """The stage that holds ``layer``.

        Raises:
            ConfigurationError: If ``layer`` is not in ``[0, L)``.
        """
        if not 0 <= layer < self.num_layers:
            raise ConfigurationError(f"layer {layer} does not exist: this layout has layers 0..{self.num_layers - 1}")
        return int(np.searchsorted(self._starts, layer, side="right")) - 1  # type: ignore[attr-defined]

    def holders(self, layer: int) -> tuple[str, ...]:
        """The members holding ``layer``, in rank order (one per replica).

        Raises:
            ConfigurationError: If ``layer`` is not in ``[0, L)``.
        """
        stage = self.stage_of_layer(layer)
        return self.members[stage :: self.pipeline_stages]

    def to_json(self) -> dict[str, Any]:
        """The layout as plain JSON types: ``{"members": [...], "partition": [...]}``."""
        return {"members": list(self.members), "partition": list(self.partition)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Layout":
        """Read a layout written by :meth:`to_json`.

        Raises:
            ConfigurationError: If a key is missing or the layout is invalid.
        """
        missing = [k for k in ("members", "partition") if k not in d]
        if missing:
            raise ConfigurationError(
                f"layout JSON lacks {', '.join(missing)}: expected {{'members': [ids...], 'partition': [ints...]}}, "
                f"got keys {sorted(d)}"
            )
        return cls(members=tuple(d["members"]), partition=tuple(d["partition"]))


# ----------------------------------------------------------------------------------------------------------------
# plan


@dataclass(frozen=True)
class Transfer:
    """One layer's state (parameters + optimizer state) copied from a live holder to a member that lacks it.

    Attributes:
        layer: Layer index.
        src: Sending member (holds ``layer`` in the old layout).
        dst: Receiving member (needs ``layer`` in the new layout).
        nbytes: Bytes of the layer's state.
    """

    layer: int
    src: str
    dst: str
    nbytes: int


@dataclass(frozen=True)
class MigrationPlan:
    """How the job moves from ``old`` to ``new``.

    Attributes:
        old: The layout before the change.
        new: The layout after the change.
        transfers: Every layer copy, ordered by the receiver's new rank, then by layer.
        kind: The kind of change (NONE, INTRA_STAGE, INTER_STAGE or REPARTITION).
        standby: Available members the new layout does not use (warm standbys), in ``available`` order.
        leaving: Old members not in the new layout, in old rank order.
    """

    old: Layout
    new: Layout
    transfers: tuple[Transfer, ...]
    kind: MigrationKind
    standby: tuple[str, ...] = ()
    leaving: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "transfers", tuple(self.transfers))
        object.__setattr__(self, "kind", MigrationKind(self.kind))
        object.__setattr__(self, "standby", tuple(self.standby))
        object.__setattr__(self, "leaving", tuple(self.leaving))

    @property
    def bytes_moved(self) -> int:
        """Total bytes of all transfers."""
        return sum(t.nbytes for t in self.transfers)

    @property
    def peak_bytes(self) -> int:
        """The most bytes one process sends or receives: transfers run in parallel between processes, so this --
        not :attr:`bytes_moved` -- is what a migration's transfer time grows with."""
        sent: dict[str, int] = {}
        received: dict[str, int] = {}
        for t in self.transfers:
            sent[t.src] = sent.get(t.src, 0) + t.nbytes
            received[t.dst] = received.get(t.dst, 0) + t.nbytes
        return max([*sent.values(), *received.values()], default=0)

    def receives(self, member: str) -> tuple[Transfer, ...]:
        """The transfers ``member`` receives."""
        return tuple(t for t in self.transfers if t.dst == member)

    def sends(self, member: str) -> tuple[Transfer, ...]:
        """The transfers ``member`` sends."""
        return tuple(t for t in self.transfers if t.src == member)

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON types (layouts as in :meth:`Layout.to_json`, kind as its string value)."""
        return {
            "old": self.old.to_json(),
            "new": self.new.to_json(),
            "transfers": [{"layer": t.layer, "src": t.src, "dst": t.dst, "nbytes": t.nbytes} for t in self.transfers],
            "kind": self.kind.value,
            "standby": list(self.standby),
            "leaving": list(self.leaving),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "MigrationPlan":
        """Read a plan written by :meth:`to_json`.

        Raises:
            ConfigurationError: If a key is missing, the kind is unknown or a layout is invalid.
        """
        missing = [k for k in ("old", "new", "transfers", "kind") if k not in d]
        if missing:
            raise ConfigurationError(
                f"migration plan JSON lacks {', '.join(missing)}: expected the keys old, new, transfers, kind "
                f"(and optionally standby, leaving), got {sorted(d)}"
            )
        try:
            kind = MigrationKind(d["kind"])
        except ValueError:
            raise ConfigurationError(
                f"unknown migration kind {d['kind']!r}: expected one of {[k.value for k in MigrationKind]}"
            ) from None
        try:
            transfers = tuple(
                Transfer(int(t["layer"]), str(t["src"]), str(t["dst"]), int(t["nbytes"])) for t in d["transfers"]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"a transfer in the plan JSON is malformed ({exc!r}): each must be "
                "{'layer': int, 'src': str, 'dst': str, 'nbytes': int}"
            ) from None
        return cls(
            old=Layout.from_json(d["old"]),
            new=Layout.from_json(d["new"]),
            transfers=transfers,
            kind=kind,
            standby=tuple(d.get("standby", ())),
            leaving=tuple(d.get("leaving", ())),
        )


# ----------------------------------------------------------------------------------------------------------------
# lexicographic assignment


def _duals(cost: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Optimal dual potentials ``u, v`` of a square assignment problem, given an optimal assignment.

    ``u[i] + v[j] <= cost[i, j]`` everywhere, with equality on ``(i, cols[i])``. Bellman-Ford on the columns: moving
    row ``i`` from its column to column ``j`` costs ``cost[i, j] - cost[i, cols[i]]``; optimality of the assignment
    means the residual graph has no negative cycle, so this converges within n rounds.
    """
    n = cost.shape[0]
    own = cost[np.arange(n), cols]
    v = np.zeros(n)
    for _ in range(n + 1):
        u = own - v[cols]
        new_v = np.minimum(v, (cost - u[:, None]).min(axis=0))
        if np.array_equal(new_v, v):
            return u, v
        v = new_v
    raise AssertionError("assignment duals did not converge: the assignment given was not optimal")  # unreachable


def _lexicographic_assignment(phases: Sequence[np.ndarray]) -> np.ndarray:
    """Minimize ``phases[0]``, then ``phases[1]`` among those optima, and so on (exactly, in integers).

    Args:
        phases: Integer cost matrices, all of shape ``(m, n)`` with ``m >= n`` (rows: candidates, columns: slots).

    Returns:
        For each row, its column, or -1 for a row left unassigned.
    """
    m, n = phases[0].shape
    allowed = np.ones((m, m), dtype=bool)
    cols = None
    for k, phase in enumerate(phases):
        square = np.zeros((m, m))
        square[:, :n] = phase  # columns n.. are "standby": free in every phase
        if not square[allowed].any() and k < len(phases) - 1:
            continue  # every allowed assignment costs 0 here: nothing to decide
        cost = np.where(allowed, square, np.inf)
        _, cols = linear_sum_assignment(cost)
        if k < len(phases) - 1:
            u, v = _duals(cost, cols)
            allowed &= (cost - u[:, None] - v[None, :]) == 0
    assert cols is not None
    return np.where(cols < n, cols, -1)


def _bottleneck(first: np.ndarray, slot_bytes: np.ndarray) -> int:
    """The least ``T`` such that some assignment optimal for ``first`` gives no slot more than ``T`` bytes to receive.

    A binary search over the values of ``slot_bytes``: at ``T`` the lexicographic assignment of ``first``, then
    "slots above ``T``", either fills every slot at or below ``T`` or not (the largest value always does).
    """
    values = np.unique(slot_bytes)
    lo, hi = 0, len(values) - 1
    rows = np.arange(slot_bytes.shape[0])
    while lo < hi:
        mid = (lo + hi) // 2
        over = (slot_bytes > values[mid]).astype(np.int64)
        cols = _lexicographic_assignment([first, over])
        if over[rows[cols >= 0], cols[cols >= 0]].sum() == 0:
            hi = mid
        else:
            lo = mid + 1
    return int(values[lo])


# ----------------------------------------------------------------------------------------------------------------
# planning


def _format_layers(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[tuple[int, int]] = []
    for x in sorted(layers):
        if runs and runs[-1][1] == x - 1:
            runs[-1] = (runs[-1][0], x)
        else:
            runs.append((x, x))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _validate(
    old: Layout,
    available: Sequence[str],
    shape: tuple[int, int],
    partition: Sequence[int],
    layer_bytes: Sequence[int],
    senders: Sequence[str] | None,
) -> tuple[tuple[str, ...], int, int, tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
    avail = _check_members(available, "available")
    try:
        d, p = (int(x) for x in shape)
    except (TypeError, ValueError):
        raise ConfigurationError(f"shape={shape!r} is not a (D, P) pair of ints") from None
    if d < 1 or p < 1:
        raise ConfigurationError(f"shape={shape!r}: D and P must both be >= 1")
    if d * p > len(avail):
        raise ConfigurationError(
            f"shape (D={d}, P={p}) needs {d * p} members but only {len(avail)} are available "
            f"({', '.join(avail) or 'none'}): pick a shape with D * P <= {len(avail)}"
        )
    part = _check_partition(partition, "the new partition")
    if len(part) != p:
        raise ConfigurationError(
            f"the new partition {list(part)} has {len(part)} stages but shape (D={d}, P={p}) has P={p}: "
            "give one layer count per stage"
        )
    if sum(part) != old.num_layers:
        raise ConfigurationError(
            f"the new partition {list(part)} covers {sum(part)} layers but the old layout has {old.num_layers}: "
            "a migration keeps the model, so both must cover the same layers"
        )
    nbytes = tuple(layer_bytes)
    if len(nbytes) != old.num_layers:
        raise ConfigurationError(
            f"layer_bytes has {len(nbytes)} entries but the model has {old.num_layers} layers: give the bytes of "
            "each layer's state (parameters + optimizer state)"
        )
    if any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0 for b in nbytes):
        raise ConfigurationError(f"layer_bytes {list(nbytes)} is invalid: every entry must be an int >= 0")
    if senders is None:
        avail_set = set(avail)
        send = tuple(m for m in old.members if m in avail_set)
    else:
        send = _check_members(senders, "senders")
        foreign = [m for m in send if old.rank_of(m) is None]
        if foreign:
            raise ConfigurationError(
                f"senders {foreign!r} are not members of the old layout and hold nothing to send: senders must be "
                "old members that can still send (survivors and members under a preemption notice)"
            )
    return avail, d, p, part, tuple(int(b) for b in nbytes), send


def plan_migration(
    old: Layout,
    available: Sequence[str],
    shape: tuple[int, int],
    partition: Sequence[int],
    layer_bytes: Sequence[int],
    *,
    senders: Sequence[str] | None = None,
) -> MigrationPlan:
    """Plan the cheapest move from ``old`` to a ``shape`` layout over the ``available`` members.

    Args:
        old: The current layout.
        available: Members in the job after the change (survivors, joiners, standbys), in order of preference.
        shape: The new ``(D, P)``.
        partition: Layers per stage of the new layout (P entries summing to ``old.num_layers``).
        layer_bytes: Bytes of each layer's state (parameters + optimizer state), one per layer.
        senders: Old members that can still send state (default: the old members in ``available``). A member under
            a preemption notice can send but is not available.

    Returns:
        The plan: new layout (slots chosen to move the fewest bytes; ties as in the module docstring), transfers
        (sources balanced by bytes), kind, standbys and leaving members.

    Raises:
        ConfigurationError: If the inputs disagree (too few members for the shape, wrong partition length or sum,
            wrong ``layer_bytes`` length, duplicate ids, a sender outside the old layout).
        StageLostError: If a layer the new layout needs has no holder among ``senders``; restart from the last
            checkpoint instead.
    """
    avail, d, p, part, nbytes, send = _validate(old, available, shape, partition, layer_bytes, senders)
    n_slots = d * p
    starts = np.concatenate(([0], np.cumsum(part)))
    num_layers = old.num_layers

    # holds[c, l]: candidate c holds layer l in the old layout; sendable[l]: some sender holds l.
    holds = np.zeros((len(avail), num_layers), dtype=bool)
    for c, member in enumerate(avail):
        held = old.layers_of(member)
        holds[c, held.start : held.stop] = True
    sendable = np.zeros(num_layers, dtype=bool)
    for member in send:
        held = old.layers_of(member)
        sendable[held.start : held.stop] = True

    # Slot k is rank k of the new layout.
    slot_stage = np.arange(n_slots) % p
    slot_replica = np.arange(n_slots) // p
    in_stage = np.zeros((p, num_layers), dtype=bool)
    for s in range(p):
        in_stage[s, starts[s] : starts[s + 1]] = True
    lacks = ~holds[:, None, :] & in_stage[None, :, :]  # (candidates, stages, layers)

    byte_vec = np.array(nbytes, dtype=np.int64)
    g = math.gcd(*nbytes) if any(nbytes) else 1
    scaled = byte_vec // g
    stage_max = max(int(scaled[starts[s] : starts[s + 1]].sum()) for s in range(p))
    if stage_max * len(avail) >= _EXACT:  # keep the solver's float64 arithmetic exact
        scaled = scaled // math.ceil(stage_max * len(avail) / _EXACT)

    # -1: a joiner (not in the old layout)
    old_rank = np.array([-1 if (r := old.rank_of(m)) is None else r for m in avail], dtype=np.int64)
    survivor = old_rank >= 0
    old_stage = np.where(survivor, old_rank % old.pipeline_stages, -1)
    old_replica = np.where(survivor, old_rank // old.pipeline_stages, -1)
    index = np.arange(len(avail))
    per_stage = {
        "unsendable": (lacks & ~sendable[None, None, :]).sum(axis=2),
        "bytes": (lacks * scaled[None, None, :]).sum(axis=2),
        "layers": lacks.sum(axis=2),
    }
    unsendable = per_stage["unsendable"][:, slot_stage]
    slot_bytes = per_stage["bytes"][:, slot_stage]
    ones = np.ones((1, n_slots), dtype=np.int64)
    rest = [
        per_stage["layers"][:, slot_stage],
        (~survivor)[:, None] * ones,
        (survivor[:, None] & (old_stage[:, None] != slot_stage[None, :])).astype(np.int64),
        (survivor[:, None] & (old_replica[:, None] != slot_replica[None, :])).astype(np.int64),
        index[:, None] * ones,
        index[:, None] * (n_slots - 1 - np.arange(n_slots))[None, :],
    ]
    slot_of = _lexicographic_assignment([unsendable, slot_bytes, *rest])
    plan = _plan_for(old, avail, slot_of, part, nbytes, send, sendable)
    rows = np.nonzero(slot_of >= 0)[0]
    busiest = int(slot_bytes[rows, slot_of[rows]].max(initial=0))
    limit = _bottleneck(unsendable, slot_bytes)
    if limit < busiest:
        # fewer bytes for the busiest receiver -- at the price of more bytes in all, which may load the senders:
        # kept only if the plan's peak (the most one process sends or receives) is lower
        over = (slot_bytes > limit).astype(np.int64)
        other = _plan_for(old, avail, _lexicographic_assignment([unsendable, over, slot_bytes, *rest]), part,
                          nbytes, send, sendable)
        if other.peak_bytes < plan.peak_bytes:
            plan = other
    return plan


def _plan_for(old: Layout, avail: Sequence[str], slot_of: np.ndarray, part: tuple[int, ...],
              nbytes: Sequence[int], send: Sequence[str], sendable: np.ndarray) -> MigrationPlan:
    """The plan whose new layout seats ``avail[c]`` at rank ``slot_of[c]`` (-1: standby)."""
    new_members = [""] * int((slot_of >= 0).sum())
    for c, k in enumerate(slot_of):
        if k >= 0:
            new_members[k] = avail[c]
    new = Layout(members=tuple(new_members), partition=part)
    used = set(new_members)
    transfers = _transfers(old, new, nbytes, send, sendable)
    if new == old:
        kind = MigrationKind.NONE
    elif new.partition != old.partition:
        kind = MigrationKind.REPARTITION
    elif any(old.stage_of(m) not in (None, new.stage_of(m)) for m in new.members):
        kind = MigrationKind.INTER_STAGE
    else:
        kind = MigrationKind.INTRA_STAGE
    return MigrationPlan(
        old=old,
        new=new,
        transfers=transfers,
        kind=kind,
        standby=tuple(m for m in avail if m not in used),
        leaving=tuple(m for m in old.members if m not in used),
    )


def _transfers(
    old: Layout, new: Layout, nbytes: Sequence[int], send: Sequence[str], sendable: np.ndarray
) -> tuple[Transfer, ...]:
    """Every layer each new member lacks, each from the eligible sender with the fewest bytes so far."""
    needed = [(m, layer) for m in new.members for layer in new.layers_of(m) if layer not in old.layers_of(m)]
    lost = sorted({layer for _, layer in needed if not sendable[layer]})
    if lost:
        stages = sorted({old.stage_of_layer(layer) for layer in lost})
        gone = [m for s in stages for m in old.members[s :: old.pipeline_stages]]
        needers = sorted({m for m, layer in needed if layer in set(lost)}, key=new.members.index)
        raise StageLostError(
            f"layers {_format_layers(lost)} (old stage{'s' if len(stages) > 1 else ''} "
            f"{', '.join(map(str, stages))}) have no live holder: every replica of "
            f"{'those stages' if len(stages) > 1 else 'that stage'} ({', '.join(gone)}) is gone or cannot send, "
            f"yet {', '.join(needers)} need{'s' if len(needers) == 1 else ''} them. No migration can rebuild this "
            "state from live peers: fall back to the last checkpoint (MigrationKind.RESTART).",
            layers=lost,
            stages=stages,
        )
    order = {m: i for i, m in enumerate(send)}
    eligible = [[m for m in old.holders(layer) if m in order] for _, layer in needed]
    load = {m: 0 for m in send}
    count = {m: 0 for m in send}
    src: list[str] = [""] * len(needed)
    # the most constrained transfers first (fewest eligible senders), the largest among them first, each from the
    # eligible sender with the fewest bytes so far (then fewest transfers, then ``send`` order)
    for i in sorted(range(len(needed)), key=lambda i: (len(eligible[i]), -nbytes[needed[i][1]], i)):
        m = min(eligible[i], key=lambda m: (load[m], count[m], order[m]))
        src[i] = m
        load[m] += nbytes[needed[i][1]]
        count[m] += 1
    _unload_busiest(src, eligible, [nbytes[layer] for _, layer in needed], load, order)
    return tuple(Transfer(layer=layer, src=src[i], dst=dst, nbytes=nbytes[layer])
                 for i, (dst, layer) in enumerate(needed))


def _unload_busiest(src: list[str], eligible: Sequence[Sequence[str]], size: Sequence[int], load: dict[str, int],
                    order: Mapping[str, int]) -> None:
    """Move transfers off the busiest sender while one can go to another eligible sender that stays below it.

    The time of a migration is the most one process sends or receives (transfers run in parallel); what each
    member receives is fixed by the slots, what each sends is chosen here. Regression (issue 21, stop 50): the
    greedy pass alone, taking transfers receiver by receiver, sent two layers from one holder of 4x6 -> 4x7 on the
    emulated GPT-1.5B (305 kB) where every receiver got at most 255 kB, and one holder each could send it; that
    move took 16-24 s on the 0.25 Gbps link. Each move strictly lowers the busiest sender's load or the number of
    senders at that load, so the loop ends; it is bounded anyway.
    """
    for _ in range(len(src) * max(len(load), 1)):
        top = max(load, key=lambda m: (load[m], -order[m]))
        moved = False
        for i in (i for i, m in enumerate(src) if m == top):
            for m in sorted(eligible[i], key=lambda m: (load[m], order[m])):
                if m != top and load[m] + size[i] < load[top]:
                    load[top] -= size[i]
                    load[m] += size[i]
                    src[i] = m
                    moved = True
                    break
            if moved:
                break
        if not moved:
            return
