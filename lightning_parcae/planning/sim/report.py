"""Run several policies on one trace and report them side by side (table, JSON, PNG).

Problem: a comparison is only useful if it is reproducible and explains itself: the same numbers must come out
of the terminal table, the JSON report a script reads, and the plot a person looks at.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

from lightning_parcae.planning.costmodel import MigrationCostModel
from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.policy import check_risk
from lightning_parcae.planning.shape_optimizer import DEFAULT_MIN_GAIN, DEFAULT_RISK, check_min_gain
from lightning_parcae.planning.sim.policies import POLICIES, PolicyResult, run_policy
from lightning_parcae.signals.traces import Trace

__all__ = ["Comparison", "simulate"]


@dataclass
class Comparison:
    """Results of several policies on one trace.

    Attributes:
        trace: The trace simulated.
        results: Policy name -> result, in the order run.
        price: USD per instance-hour used for the cost columns.
        settings: Options recorded in the report (model, cost model, look-ahead, ...).
    """

    trace: Trace
    results: Dict[str, PolicyResult]
    price: float
    settings: Dict[str, object] = field(default_factory=dict)

    def table(self) -> str:
        """A fixed-width table, one row per policy."""
        head = (
            f"{'policy':<14} {'samples':>12} {'samples/s':>10} {'vs thr.':>8} {'reconf.':>8} {'lost (s)':>9} "
            f"{'inst-h':>8} {'USD':>8} {'USD/M samples':>14}"
        )
        rows = [head, "-" * len(head)]
        base = self.results.get("throughput")
        for name, r in self.results.items():
            s = r.summary(self.price)
            vs = f"{100.0 * (r.samples / base.samples - 1):+.1f}%" if base and base.samples > 0 else "-"
            per_m = s["usd_per_million_samples"]
            rows.append(
                f"{name:<14} {s['samples']:>12.1f} {s['mean_samples_per_s']:>10.2f} {vs:>8} "
                f"{s['reconfigurations']:>8d} {s['lost_s']:>9.1f} {s['instance_hours']:>8.2f} {s['usd']:>8.2f} "
                f"{per_m if math.isfinite(per_m) else float('nan'):>14.2f}"
            )
        return "\n".join(rows)

    def to_json(self) -> dict:
        """The report: ``{"policies": {name: {...}}, "trace": {...}, "settings": {...}}``.

        Undefined numbers (e.g. USD per million samples of a policy that trained nothing) are ``None``, so the
        report is strict JSON.
        """
        return _finite_or_none({
            "policies": {
                name: dict(
                    r.summary(self.price),
                    timeline={
                        "counts": r.counts,
                        "shapes": [list(s) for s in r.shapes],
                        "cumulative_samples": r.cumulative,
                        "cost_ms": r.cost_ms,
                    },
                )
                for name, r in self.results.items()
            },
            "trace": {
                "source": self.trace.source,
                "intervals": len(self.trace),
                "interval_s": self.trace.interval_s,
                "max_instances": self.trace.max_n,
            },
            "settings": dict(self.settings, price_usd_per_instance_hour=self.price),
        })

    def save_json(self, path: str) -> None:
        """Write :meth:`to_json` atomically (temp file, then rename)."""
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".json.tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=1, allow_nan=False, default=_json_default)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def plot(self, path: str) -> None:
        """Save a PNG: availability, chosen D x P per policy, cumulative samples per policy."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        hours = [(i + 1) * self.trace.interval_s / 3600.0 for i in range(len(self.trace))]
        fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
        axes[0].step(hours, list(self.trace.counts()), where="post", color="black")
        axes[0].set_ylabel("instances")
        axes[0].set_title(f"{os.path.basename(str(self.trace.source))}: availability, shape and progress")
        for name, r in self.results.items():
            axes[1].step(hours, [d * p for d, p in r.shapes], where="post", label=f"{name} (D*P)")
            axes[2].plot(hours, r.cumulative, label=name)
        axes[1].set_ylabel("instances used (D x P)")
        axes[1].legend(fontsize=8, ncol=3)
        axes[2].set_ylabel("cumulative samples")
        axes[2].set_xlabel("hours")
        axes[2].legend(fontsize=8)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=90)
        plt.close(fig)


def _finite_or_none(o: object) -> object:
    """``o`` with every non-finite float (inf, nan) replaced by None, recursively."""
    if isinstance(o, dict):
        return {k: _finite_or_none(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite_or_none(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def _json_default(o: object) -> object:
    if hasattr(o, "item"):
        return o.item()  # numpy scalars
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def simulate(
    trace: Trace,
    cost_model: MigrationCostModel,
    policies: Sequence[str] = ("ideal", "throughput", "parcae", "parcae-oracle"),
    *,
    look_ahead: int = 12,
    predictor: str = "persistence",
    price: float = 3.06 * 0.3,
    settings: Optional[Dict[str, object]] = None,
    risk: Optional[float] = None,
    min_gain: Optional[float] = None,
    charge_unmeasured: bool = True,
) -> Comparison:
    """Run ``policies`` on ``trace``.

    Args:
        trace: The availability trace.
        cost_model: Throughput + migration costs (artifact-compatible or our own).
        policies: Names from :data:`~lightning_parcae.planning.sim.policies.POLICIES`.
        look_ahead: Intervals the parcae policies plan over.
        predictor: Predictor name for ``parcae``.
        price: USD per instance-hour (default: a p3.2xlarge at a 70 % spot discount).
        settings: Extra fields recorded in the report.
        risk: Standard deviations of gain ``parcae``'s departures from reacting must clear (default: the
            runtime's, :data:`~lightning_parcae.planning.shape_optimizer.DEFAULT_RISK`).
        min_gain: The least fraction of the reactive plan's expected value ``parcae``'s departures must gain
            besides the risk rule (default: the runtime's,
            :data:`~lightning_parcae.planning.shape_optimizer.DEFAULT_MIN_GAIN`).
        charge_unmeasured: Whether ``parcae``'s departures to shapes the cost model has not measured also clear
            the fit's error (as the runtime's default; only a measured profile has unmeasured shapes).

    Returns:
        The comparison.
    """
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ConfigurationError(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    if price < 0:
        raise ConfigurationError(f"price={price}: USD per instance-hour cannot be negative")
    intervals = trace.as_tuples()
    risk = DEFAULT_RISK if risk is None else check_risk(risk)
    min_gain = DEFAULT_MIN_GAIN if min_gain is None else check_min_gain(min_gain)
    results = {
        name: run_policy(name, cost_model, intervals, trace.interval_s, look_ahead=look_ahead, predictor=predictor,
                         risk=risk, min_gain=min_gain, charge_unmeasured=bool(charge_unmeasured))
        for name in policies
    }
    s = dict(settings or {}, look_ahead=look_ahead, predictor=predictor, risk=risk, min_gain=min_gain,
             charge_unmeasured=bool(charge_unmeasured))
    return Comparison(trace, results, price, s)
