"""The worker contract: what a launcher tells a worker, and what a worker's exit status tells the launcher.

Problem: ``parcae run``, ``parcae agent``, the Lightning strategy and the runtime are separate processes and
layers that must agree on a handful of names and numbers -- the environment variables a worker is started with and
the exit statuses by which it says "restart the job from the checkpoint" or "restart me as a standby". Spelled out
in each module, they drifted (three modules defined ``PARCAE_STORE``, two ``PARCAE_RUN_DIR``). They live here,
below every layer, and everything else imports them. ``docs/failure_contract.md`` describes the behaviour behind
each exit status.

:func:`worker_contract` builds a worker's ``PARCAE_*`` variables from these names -- the one builder used by ``parcae
run``'s two modes and by ``parcae agent`` (it was assembled three times, in three modules).

Store keys and records stay with their owners (:mod:`lightning_parcae.runtime.store`,
:mod:`lightning_parcae.runtime.coordinator`, :mod:`lightning_parcae.runtime.liveness`): only one module encodes and
decodes each of them. A preemption notice in the store is built by
:func:`~lightning_parcae.runtime.liveness.notice_record` and signed with the job token like every other record,
whether the launcher (``parcae run``) or an agent (``parcae agent``) writes it; the worker refuses one that is not.
"""

from __future__ import annotations

from os import PathLike
from typing import Optional, Union

__all__ = [
    "worker_contract",
    "ENV_PREFIX", "RUN_DIR_ENV", "RESUME_ENV", "CHECKPOINT_DIR_ENV", "MAX_INSTANCES_ENV", "STORE_ENV", "JOB_TOKEN_ENV", "MEMBER_ENV", "JOIN_ENV",
    "GENERATION_ENV", "GENERATION_BASE_ENV", "ROSTER_ENV", "PIPELINE_ENV", "INTERVAL_ENV", "MODE_ENV", "ELASTIC_ENV", "STALL_ENV",
    "SHARED_CORES_ENV", "WRONG_TOKEN_EXIT", "FALLBACK_EXIT", "RELEASED_EXIT", "FENCED_EXIT",
]

# ------------------------------------------------------------------------------------ launcher -> worker (env)
ENV_PREFIX = "PARCAE_"
"""Every variable of the contract starts with it; a launcher drops inherited ones before setting its own."""
RUN_DIR_ENV = "PARCAE_RUN_DIR"
"""The run directory (checkpoints, events, logs)."""
RESUME_ENV = "PARCAE_RESUME_CKPT"
MAX_INSTANCES_ENV = "PARCAE_MAX_INSTANCES"
"""The largest instance count of the job (the forecasts' upper bound; the runtime assumes 64 when unset)."""
CHECKPOINT_DIR_ENV = "PARCAE_CHECKPOINT_DIR"
"""Where the launcher's checkpoints go: a local path, a shared mount or an fsspec URL (``s3://bucket/job``); unset:
``run_dir/ckpt/last.ckpt`` on the writer's own disk (see :mod:`lightning_parcae.runtime.checkpoint_store`)."""
"""On a relaunch: the checkpoint to resume from (used when ``fit`` gets no ``ckpt_path``)."""
STORE_ENV = "PARCAE_STORE"
"""The coordination store (``tcp://host:port`` or ``etcd://host:port``) that outlives the workers."""
JOB_TOKEN_ENV = "PARCAE_JOB_TOKEN"
"""The job token that authenticates this job's store records."""
MEMBER_ENV = "PARCAE_MEMBER"
"""This worker's stable member id (``i0``, ``i1``, ...)."""
JOIN_ENV = "PARCAE_JOIN"
"""``1``: start as a standby that waits to be admitted into the running job."""
GENERATION_ENV = "PARCAE_GENERATION"
"""The launch number (a restart from the checkpoint is a new launch)."""
GENERATION_BASE_ENV = "PARCAE_GENERATION_BASE"
"""First generation number of this launch (generations of different launches never collide)."""
ROSTER_ENV = "PARCAE_ROSTER"
"""Set: this worker is a *start-up candidate* of a ``parcae run`` launch. Once it has imported and connected it
reports its arrival and waits for the launch's roster under this store key
(:mod:`lightning_parcae.runtime.startup`): a member takes its rank from it (``RANK`` / ``WORLD_SIZE`` are only
0 / 1 placeholders), anyone else starts as a standby. Unset: ``RANK`` / ``WORLD_SIZE`` are given (``parcae agent``,
torchrun, a joiner)."""
PIPELINE_ENV = "PARCAE_PIPELINE_STAGES"
"""The first pipeline depth P (``auto``: the strategy chooses)."""
INTERVAL_ENV = "PARCAE_INTERVAL_S"
"""The planning interval in wall seconds."""
MODE_ENV = "PARCAE_MODE"
"""``elastic`` (live reconfiguration) or ``restart`` (every change restarts from the checkpoint)."""
ELASTIC_ENV = "PARCAE_ELASTIC"
"""``0``: the strategy runs with a fixed shape even under the launcher."""
STALL_ENV = "PARCAE_STALL_S"
"""The progress watchdog in seconds (overrides ``stall_after_s``)."""
SHARED_CORES_ENV = "PARCAE_SHARED_CORES"
"""All workers on one machine: the cores they share (the measured model's contention term). Unset on a cluster."""



def worker_contract(*, store: str, token: Optional[str], elastic: bool, run_dir: Union[str, PathLike[str], None] = None,
                    member: Optional[str] = None, join: Optional[bool] = None, generation: Optional[int] = None,
                    pipeline_stages: Optional[str] = None, mode: Optional[str] = None,
                    interval_s: Optional[float] = None, stall_s: Optional[float] = None,
                    shared_cores: Optional[int] = None,
                    resume: Union[str, PathLike[str], None] = None,
                    checkpoint_dir: Optional[str] = None, max_instances: Optional[int] = None,
                    roster: Optional[str] = None) -> dict[str, str]:
    """The ``PARCAE_*`` variables of one worker; a variable whose argument is None (or a falsy token / stall) is
    left out, so the worker's default applies.

    Args:
        store: :data:`STORE_ENV`.
        token: :data:`JOB_TOKEN_ENV` (None or empty: an open store).
        elastic: :data:`ELASTIC_ENV` (``1`` / ``0``).
        run_dir: :data:`RUN_DIR_ENV`.
        member: :data:`MEMBER_ENV`.
        join: :data:`JOIN_ENV` (``1`` / ``0``).
        generation: :data:`GENERATION_ENV`, and :data:`GENERATION_BASE_ENV` as ``1000 * generation``.
        pipeline_stages: :data:`PIPELINE_ENV` (a number or ``auto``).
        mode: :data:`MODE_ENV`.
        interval_s: :data:`INTERVAL_ENV` (``%g``).
        stall_s: :data:`STALL_ENV` (``%g``; None or 0: not set).
        shared_cores: :data:`SHARED_CORES_ENV`.
        resume: :data:`RESUME_ENV`.
        checkpoint_dir: :data:`CHECKPOINT_DIR_ENV`.
        max_instances: :data:`MAX_INSTANCES_ENV`.
        roster: :data:`ROSTER_ENV` (the store key of the launch's start-up roster).
    """
    env = {ELASTIC_ENV: "1" if elastic else "0", STORE_ENV: store}
    if token:
        env[JOB_TOKEN_ENV] = token
    if member is not None:
        env[MEMBER_ENV] = member
    if join is not None:
        env[JOIN_ENV] = "1" if join else "0"
    if run_dir is not None:
        env[RUN_DIR_ENV] = str(run_dir)
    if generation is not None:
        env[GENERATION_ENV], env[GENERATION_BASE_ENV] = str(generation), str(1000 * generation)
    if pipeline_stages is not None:
        env[PIPELINE_ENV] = pipeline_stages
    if mode is not None:
        env[MODE_ENV] = mode
    if interval_s is not None:
        env[INTERVAL_ENV] = f"{interval_s:g}"
    if stall_s:
        env[STALL_ENV] = f"{stall_s:g}"
    if shared_cores is not None:
        env[SHARED_CORES_ENV] = str(shared_cores)
    if resume is not None:
        env[RESUME_ENV] = str(resume)
    if checkpoint_dir:
        env[CHECKPOINT_DIR_ENV] = checkpoint_dir
    if max_instances is not None:
        env[MAX_INSTANCES_ENV] = str(max_instances)
    if roster is not None:
        env[ROSTER_ENV] = roster
    return env


# ------------------------------------------------------------------------------------ worker -> launcher (exit)
WRONG_TOKEN_EXIT = 3
"""The store rejected this worker's job token: a configuration error, reported as such, never retried."""
FALLBACK_EXIT = 75
"""Some stage lost every replica (or no instance is left): restart the job from the last checkpoint."""
RELEASED_EXIT = 76
"""Fenced after a plan that does not use this healthy member: restart it as a standby (``PARCAE_JOIN=1``)."""
FENCED_EXIT = 77
"""Fenced after being declared dead while silent: it must not touch the job again; restart it as a standby."""
