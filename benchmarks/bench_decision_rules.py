"""What a decision rule costs or gains in the simulator, over the profiles real replays measured.

A rule of the liveput decision (how sure a departure must be, ``risk``; how much it must gain, ``min_gain``) is
chosen on a few replays, each one pass of ~24 minutes on this machine, whose outcomes differ by up to 3 % between
passes. The simulator can ask the same question of many cases at once: here every measured profile a replay left
(``profile.json`` of a parcae or reactive run: its step times, fitted throughput model and migration constants)
prices the four bundled p3 segments as ``benchmarks/bench_replay.py --job gpt15b --time-scale 3 --max-instances 32
--intervals 30 --pipeline-stages 6`` replays them -- the launcher's first generation (4x6 on 32), the leader's veto,
the join delay of a restarted standby -- and each variant of the options runs the simulated parcae policy against
live-reactive on every case. The profiles of stops 53-55 are kept in ``docs/evidence/profiles/`` for this.

Every figure is modelled (the simulator takes the fitted estimates for the truth): a rule that wins here has still
to win in a replay (docs/evidence.md).

    python benchmarks/bench_decision_rules.py --variants "min_gain=0;min_gain=0.01;min_gain=0.03"
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_replay  # noqa: E402

from lightning_parcae.errors import ConfigurationError  # noqa: E402
from lightning_parcae.planning.policy import check_risk  # noqa: E402
from lightning_parcae.planning.shape_optimizer import check_min_gain  # noqa: E402

SEGMENTS = ("hh_55_65", "hl_15_25", "lh_80_90", "ll_10_11")
PROFILES = Path(__file__).resolve().parent.parent / "docs" / "evidence" / "profiles"
JOIN_DELAY_S = 22.0
"""Seconds from an arrival to a usable standby in the 0.25 Gbps replays at time scale 3 (a restarted process)."""
OPTIONS = {"risk": check_risk, "min_gain": check_min_gain, "hold_risk": check_risk}


def parse_variants(text: str) -> list[dict[str, float]]:
    """``"min_gain=0;min_gain=0.01,risk=0.5"`` -> one dict of options per variant (``;`` between variants).

    Raises:
        ConfigurationError: An option other than ``risk`` / ``min_gain``, or a value out of its range.
    """
    out = []
    for part in [p.strip() for p in text.split(";") if p.strip()]:
        v: dict[str, float] = {}
        for item in [i.strip() for i in part.split(",") if i.strip()]:
            name, _, value = item.partition("=")
            if name not in OPTIONS or not value:
                raise ConfigurationError(f"--variants: {item!r} is not NAME=VALUE with NAME one of "
                                         f"{', '.join(OPTIONS)} (e.g. \"min_gain=0;min_gain=0.01,risk=0.5\")")
            v[name] = OPTIONS[name](value, name)
        out.append(v)
    if not out:
        raise ConfigurationError(f"--variants {text!r}: give at least one variant, e.g. \"min_gain=0;min_gain=0.01\"")
    return out


def label(variant: dict[str, float]) -> str:
    """A variant as given on the command line (``"defaults"`` when it names no option)."""
    return ",".join(f"{k}={v:g}" for k, v in variant.items()) or "defaults"


def study(profiles: list[Path], variants: list[dict[str, float]], intervals: int, out: Path) -> list[dict[str, Any]]:
    """parcae / live-reactive of each variant on each profile x segment (printed as it goes)."""
    from lightning_parcae.launch.run import _load_schedule  # noqa: PLC0415

    schedules = {seg: _load_schedule(bench_replay._sliced(seg, intervals, out), 60.0, 32)[1] for seg in SEGMENTS}
    rows = []
    for prof in profiles:
        for seg, sched in schedules.items():
            ratios = []
            for v in variants:
                f = bench_replay.forecast(prof, sched, 20.0, 0.0, None, min(sched), pipeline_stages=6,
                                          join_delay_s=JOIN_DELAY_S, in_place_only=True, **v)
                ratios.append(f["parcae"] / f["reactive"])
            rows.append({"profile": prof.name, "segment": seg, "ratios": ratios})
            print(f"{prof.name:34s} {seg}  " + "  ".join(f"{r:.4f}" for r in ratios), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", nargs="*", type=Path,
                    help=f"profile.json files (default: every *.json in {PROFILES.relative_to(PROFILES.parents[2])})")
    ap.add_argument("--variants", default="min_gain=0;min_gain=0.01",
                    help="';'-separated variants, each ','-separated NAME=VALUE of risk / min_gain / hold_risk (default: "
                    "\"min_gain=0;min_gain=0.01\"); unnamed options take the strategy's defaults")
    ap.add_argument("--intervals", type=int, default=30, help="first K intervals of each segment (default 30)")
    ap.add_argument("--out", default="/tmp/bench_decision_rules", help="folder for the sliced traces")
    a = ap.parse_args(argv)
    try:
        variants = parse_variants(a.variants)
    except ConfigurationError as exc:
        raise SystemExit(str(exc)) from None
    profiles = a.profiles or sorted(PROFILES.glob("*.json"))
    missing = [p for p in profiles if not p.is_file()]
    if not profiles or missing:
        raise SystemExit(f"no profile.json to study: {missing or PROFILES} (give the profile.json of replay runs)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print("parcae / live-reactive per variant: " + "  ".join(label(var) for var in variants))
    rows = study(profiles, variants, a.intervals, out)
    for i, var in enumerate(variants):
        r = [row["ratios"][i] for row in rows]
        print(f"{label(var):24s} mean {statistics.mean(r):.4f}  min {min(r):.4f}  max {max(r):.4f}  "
              f"below 1: {sum(x < 1 - 1e-9 for x in r)} of {len(r)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
