"""A previous run's measured profile as this run's starting prices: what a migration costs before the first one.

Problem: the leader prices migrations by what this job's own migrations have cost (the fit of
:meth:`~lightning_parcae.planning.costmodel.MigrationConstants.fit`), but until the first one is measured it has
only the runtime's loopback constants -- a group rebuild of 30 ms and state at 10 Gbps. On a job whose stages take
seconds to move, that first move is priced at milliseconds, so the first decision is live-reactive's whatever the
forecast says. Regression (issue 21, stop 48, emulated GPT-1.5B with its state at 0.25 Gbps on the p3 segment
lh_80_90): the simulator, given the migration constants the run fitted afterwards, held 4x6 while the count rose to
28-32 (a repartition to 4x7 costs more than it wins back before the next dip); the runtime repartitioned to 4x7 at
the first arrival because that first repartition was priced at 10 Gbps -- and then paid 16-27 s per move.

Parcae profiles migration costs before training (the artifact ships them per model and instance type); this
runtime learns them while training and saves them in ``run_dir/profile.json``. A ``prior_profile`` (the strategy
option: a path or an fsspec URL of such a file, from an earlier run of the same job or one on the same instances
and network) gives the leader that file's migration constants from the start; the constants are refitted on top of
it as this job migrates. Its measured step times are taken as well when they are step times of *this* job -- the
same global batch, micro-batches and per-layer state bytes (``layer_bytes``); otherwise only the constants are
(step times of another batch size or model would price every shape wrong), and the ``prior_profile`` event says
why. Measurements a previous leader of this job published in the store win over the prior: they are this run's.

The failure contract: a prior that cannot be read, is not a measured profile or has no migration constants is a
:class:`~lightning_parcae.errors.ConfigurationError` when the strategy is built, naming the file and the fix --
never a silent fall-back to the loopback prices the option was given to replace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.costmodel import MigrationConstants
from lightning_parcae.planning.measured import PROFILE_FORMAT

__all__ = ["PriorProfile", "read_prior_profile"]

_LAYER_BYTES_RTOL = 0.01
"""Per-layer state bytes of the prior and of this job agree within this relative tolerance: the same model (the
saved profile rounds nothing, but an optimizer-state factor written as 2 or 2.0 must not make it "another model")."""


@dataclass(frozen=True)
class PriorProfile:
    """A previous run's ``profile.json``, checked.

    Attributes:
        source: Where it was read from (path or URL).
        constants: Its migration constants (what its migrations were fitted to cost).
        raw: The whole file (``shapes`` holds its measured step times).
    """

    source: str
    constants: MigrationConstants
    raw: dict[str, Any]

    def step_times_for(self, global_batch: int, micro_batches: int,
                       layer_bytes: Sequence[float]) -> tuple[dict[str, Any], Optional[str]]:
        """The prior's measured shapes if they are this job's, else none and why.

        Args:
            global_batch: This job's global batch.
            micro_batches: This job's micro-batches per step.
            layer_bytes: This job's per-layer state bytes (weights and optimizer state).

        Returns:
            ``(shapes, mismatch)``: ``shapes`` as saved (``{"D,P": {"step_ms": [...]}}``) and ``None``, or ``{}``
            and a sentence naming what differs.
        """
        raw = self.raw
        if int(raw.get("global_batch", -1)) != int(global_batch):
            return {}, f"global batch {raw.get('global_batch')} in the prior, {global_batch} in this job"
        if int(raw.get("micro_batches", -1)) != int(micro_batches):
            return {}, f"micro-batches {raw.get('micro_batches')} in the prior, {micro_batches} in this job"
        theirs = [float(b) for b in raw.get("layer_bytes") or []]
        ours = [float(b) for b in layer_bytes]
        if len(theirs) != len(ours) or any(abs(a - b) > _LAYER_BYTES_RTOL * max(abs(b), 1.0)
                                           for a, b in zip(theirs, ours)):
            return {}, (f"per-layer state bytes differ ({len(theirs)} layers in the prior, {len(ours)} in this "
                        "job, or other sizes): another model")
        return dict(raw.get("shapes") or {}), None


def read_prior_profile(url: str) -> PriorProfile:
    """Read and check a previous run's ``profile.json`` (a local path or any URL fsspec opens: ``s3://...``).

    Raises:
        ConfigurationError: It cannot be read, is not JSON, is not a measured profile, or has no valid migration
            constants -- naming the file and what to pass instead.
    """
    fix = ("pass the profile.json an earlier `parcae run` wrote in its run directory (it holds the migration "
           "constants that run measured), or leave prior_profile unset")
    try:
        import fsspec  # noqa: PLC0415 -- only a job given a prior pays the import

        with fsspec.open(url, "r") as f:
            raw = json.load(f)
    except (OSError, ValueError, ImportError) as e:
        raise ConfigurationError(f"prior_profile={url!r} cannot be read ({type(e).__name__}: {e}): {fix}") from None
    if not isinstance(raw, dict) or raw.get("format") != PROFILE_FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise ConfigurationError(f"prior_profile={url!r} is not a measured profile (format {got!r}, expected "
                                 f"{PROFILE_FORMAT!r}; a layer profile has no migration costs): {fix}")
    try:
        constants = MigrationConstants(**raw["migration_constants"])
        if not constants.bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s={constants.bandwidth_bytes_per_s}")
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigurationError(f"prior_profile={url!r} has no valid migration_constants ({type(e).__name__}: "
                                 f"{e}): {fix}") from None
    return PriorProfile(source=url, constants=constants, raw=raw)
