"""The validated options of one ``parcae run``.

Problem: the launcher and each of its parts (:mod:`.fleet`, :mod:`.relaunch`, :mod:`.console`) need the run's
options; they get this one typed object, checked once by :func:`lightning_parcae.launch.run.build_parser`'s caller,
instead of reading them through the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from lightning_parcae.launch.processes import ELASTIC

__all__ = ["RunConfig", "DEFAULT_TIME_SCALE"]

DEFAULT_TIME_SCALE = 20.0
"""``--time-scale``: a 1-hour segment of 60-s intervals replays in 3 minutes."""


@dataclass
class RunConfig:
    """Validated options of one ``parcae run`` (read-only once the launcher has it)."""

    instances: int
    command: list[str]
    run_dir: Path
    trace: Optional[str] = None
    time_scale: float = DEFAULT_TIME_SCALE
    interval_s: float = 60.0
    grace_s: float = 120.0
    max_instances: int = 1
    pipeline_stages: str = "1"
    store_host: str = "127.0.0.1"
    store_url: Optional[str] = None
    store_timeout_s: float = 10.0
    startup_timeout_s: float = 120.0
    progress_every_s: float = 2.0
    plot: bool = True
    mode: str = ELASTIC
    max_restarts: int = 3
    stall_timeout_s: Optional[float] = None
    emulated_devices: bool = False
    victims: str = "newest"
    seed: int = 0
    schedule: list[int] = field(default_factory=list)
    """Instances during each (scaled) replay interval; empty for a static cluster."""
    trace_counts: list[int] = field(default_factory=list)
    checkpoint_dir: Optional[str] = None
    trace_clock: str = "launch"
    """When the trace's time starts: at the launch, or at the first training step (``first-step``)."""
    """``--checkpoint-dir``: a local path, shared mount or fsspec URL that outlives every instance (None: the legacy
    ``run_dir/ckpt/last.ckpt``, written on the disk of whichever member is rank 0)."""

    @property
    def wall_interval_s(self) -> float:
        """One trace interval in wall seconds."""
        return self.interval_s / self.time_scale

    @property
    def wall_grace_s(self) -> float:
        """The notice period in wall seconds."""
        return self.grace_s / self.time_scale

    @property
    def checkpoint(self) -> Path:
        """``run_dir/ckpt/last.ckpt``: the checkpoint every relaunch resumes from without ``--checkpoint-dir``."""
        return self.run_dir / "ckpt" / "last.ckpt"

    def resume_checkpoint(self) -> tuple[Optional[Union[str, Path]], Optional[int]]:
        """What a relaunch resumes from: (path or URL, its step -- None when only the event log knows it), or
        (None, None) for a fresh start. With ``--checkpoint-dir`` the newest complete checkpoint there, whoever
        wrote it; a store that cannot be listed now is reported and treated as empty."""
        from lightning_parcae.runtime.checkpoint_store import resume_point  # noqa: PLC0415

        return resume_point(self.checkpoint_dir, self.checkpoint, lambda m: print(f"[parcae run] {m}", flush=True))
