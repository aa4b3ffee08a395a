"""benchmarks/device_replay.sh: the prepared N = 32 replay for a lent 16-core machine must be runnable as written.

It cannot run here in full (32 processes of the emulated GPT-1.5B need ~16 cores; a smoke run at N = 6 takes ~5
minutes: ``PARCAE_DEVICE_MAX=6 PARCAE_DEVICE_SHAPES=1x6 PARCAE_DEVICE_INTERVALS=4 PARCAE_DEVICE_SCALE=10``). These
tests pin what a device session cannot afford to find out there: the script parses, its default shapes are
shapes the workload accepts, and its default time scale leaves the modelled step long enough for 32 processes'
real CPU on 16 cores.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from lightning_parcae.testing.emulated_cluster import EmulatedWorkload

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "device_replay.sh"
CPU_PER_PROCESS_STEP_S = 0.27
"""Real CPU seconds per process and step of the emulated GPT-1.5B example (measured at N = 24, stop 30)."""


def _default(name: str) -> str:
    match = re.search(r"\$\{" + name + r":-([^}]+)\}", SCRIPT.read_text())
    assert match, f"{name} has no default in {SCRIPT.name}"
    return match.group(1)


def test_device_replay_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_device_replay_defaults_are_shapes_the_workload_accepts_and_keep_the_cpu_below_60_percent() -> None:
    scale, peak = float(_default("PARCAE_DEVICE_SCALE")), int(_default("PARCAE_DEVICE_MAX"))
    workload = EmulatedWorkload.gpt_1_5b(time_scale=scale).coarsened(24)
    for shape in _default("PARCAE_DEVICE_SHAPES").split(","):
        d, p = (int(x) for x in shape.split("x"))
        assert d * p <= peak and p >= 6, shape  # the modelled 16 GB rule needs P >= 6
        step = workload.step_s(d, p, 16)  # raises when D does not divide the global batch over M = 16
        cpu_share = d * p * CPU_PER_PROCESS_STEP_S / 16 / step  # 16 cores on the device machine
        assert cpu_share <= 0.6, f"{shape} at scale {scale}: the CPU would be {cpu_share:.0%} busy"
