"""The worker contract: what a launcher tells a worker, and what a worker's exit status tells the launcher.

Problem: ``parcae run``, ``parcae agent``, the Lightning strategy and the runtime are separate processes and
layers that must agree on a handful of names and numbers -- the environment variables a worker is started with and
the exit statuses by which it says "restart the job from the checkpoint" or "restart me as a standby". Spelled out
in each module, they drifted (three modules defined ``PARCAE_STORE``, two ``PARCAE_RUN_DIR``). They live here,
below every layer, and everything else imports them. ``docs/failure_contract.md`` describes the behaviour behind
each exit status.

Store keys and notice records stay with their owners (:mod:`lightning_parcae.runtime.store`,
:mod:`lightning_parcae.runtime.coordinator`, :mod:`lightning_parcae.signals.notices`): only one module writes and
reads each of them.
"""

from __future__ import annotations

__all__ = [
    "ENV_PREFIX", "RUN_DIR_ENV", "RESUME_ENV", "STORE_ENV", "JOB_TOKEN_ENV", "MEMBER_ENV", "JOIN_ENV",
    "GENERATION_ENV", "GENERATION_BASE_ENV", "PIPELINE_ENV", "INTERVAL_ENV", "MODE_ENV", "ELASTIC_ENV", "STALL_ENV",
    "SHARED_CORES_ENV", "WRONG_TOKEN_EXIT", "FALLBACK_EXIT", "RELEASED_EXIT", "FENCED_EXIT",
]

# ------------------------------------------------------------------------------------ launcher -> worker (env)
ENV_PREFIX = "PARCAE_"
"""Every variable of the contract starts with it; a launcher drops inherited ones before setting its own."""
RUN_DIR_ENV = "PARCAE_RUN_DIR"
"""The run directory (checkpoints, events, logs)."""
RESUME_ENV = "PARCAE_RESUME_CKPT"
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

# ------------------------------------------------------------------------------------ worker -> launcher (exit)
WRONG_TOKEN_EXIT = 3
"""The store rejected this worker's job token: a configuration error, reported as such, never retried."""
FALLBACK_EXIT = 75
"""Some stage lost every replica (or no instance is left): restart the job from the last checkpoint."""
RELEASED_EXIT = 76
"""Fenced after a plan that does not use this healthy member: restart it as a standby (``PARCAE_JOIN=1``)."""
FENCED_EXIT = 77
"""Fenced after being declared dead while silent: it must not touch the job again; restart it as a standby."""
