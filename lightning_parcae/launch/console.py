"""What ``parcae run`` shows and writes: the event log it reads, progress lines, change lines, the report.

Problem: a user watching a spot cluster wants each change as it happens (notices, plans, migrations, restarts), a
progress line every few seconds, and at the end ``report.json`` / ``report.png`` with what every migration and
restart cost. The launcher's process management should not be tangled with formatting: :class:`Console` reads the
workers' events from ``run_dir/events.jsonl`` into the :class:`~.state.WorkerReports` it owns and turns them into
lines and the report. It only reads and reports: it reads the run's :class:`~.state.RunState` but never changes it
(the launcher acts on the events it returns -- a first step, a checkpoint, the end).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

from lightning_parcae.launch.config import RunConfig
from lightning_parcae.launch.processes import ELASTIC, WorkerControl
from lightning_parcae.launch.state import Phase, RunState, WorkerReports

__all__ = ["Console"]


class Console:
    """Console output and the report of one launcher run.

    Args:
        cfg: The run's options.
        state: The run's state (read only).
        reports: What the workers reported: written here only, from the event log.
        pool: The worker processes (read only: standbys and whether a generation runs).
        out: Where the lines go.
    """

    def __init__(self, cfg: RunConfig, state: RunState, reports: WorkerReports, pool: WorkerControl,
                 out: TextIO) -> None:
        self.cfg, self.state, self.reports, self.pool, self.out = cfg, state, reports, pool, out
        self._offset = 0
        self._last_line = 0.0
        self._recoveries: set[Any] = set()
        self._recovering_since: dict[int, float] = {}

    def read_new(self) -> list[dict[str, Any]]:
        """The events appended to ``run_dir/events.jsonl`` since the last call (complete lines only); not yet
        recorded (see :meth:`record`)."""
        path = self.cfg.run_dir / "events.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def record(self, ev: dict[str, Any]) -> None:
        """Take one event into the reports (and print what a change line says)."""
        rep = self.reports
        rep.events.append(ev)
        if ev.get("source") == "worker":
            if ev.get("global_batch"):
                rep.batch = (int(ev["global_batch"]), int(ev.get("micro_batches") or 1))
            rate = ev.get("samples_per_s", rep.latest.get("samples_per_s", 0.0))
            if ev.get("event") != "progress" and ev.get("generation") == rep.latest.get("generation"):
                rate = rep.latest.get("samples_per_s", 0.0)  # only progress events carry a fresh rate
            rep.latest = {**ev, "samples_per_s": rate}
        elif ev.get("source") == "elastic":
            self.on_elastic_event(ev)

    def say(self, msg: str) -> None:
        """Print one line, stamped with the seconds since the run started."""
        print(f"[parcae run {time.time() - self.state.t0:6.1f}s] {msg}", file=self.out, flush=True)

    def on_elastic_event(self, ev: dict[str, Any]) -> None:
        """Follow what the workers' live-reconfiguration runtime reports (phases, plans, migrations, losses)."""
        rep = self.reports
        member = str(ev.get("member", ""))
        kind = ev.get("event")
        t = float(ev.get("time", time.time())) - self.state.t0
        if kind == "arrived":
            rep.arrived.setdefault(member, float(ev.get("time", time.time())))
        elif kind == "phase":
            rep.phases[member] = str(ev.get("new"))
            g = int(ev.get("generation", -1))
            if ev.get("new") == "recovering":
                self._recovering_since.setdefault(g, t)
            if ev.get("new") == "training" and ev.get("old") == "starting" and g > rep.egen:  # a (re)launch trains
                rep.egen = g
                d, p = int(ev.get("D", 0) or 0), int(ev.get("P", 0) or 0)
                rep.shapes.append({"t": t, "N": d * p, "D": d, "P": p, "generation": g, "why": "launch"})
        elif kind == "decision":
            rep.decision = ev
            if ev.get("chosen") != ev.get("current") or ev.get("leaving"):
                cur, new = ev.get("current") or [0, 0], ev.get("chosen")
                to = f"{new[0]}x{new[1]}" if new else "no shape (fallback)"
                self.say(f"plan: {cur[0]}x{cur[1]} -> {to} for N={ev.get('N')} ({ev.get('reason')}; predicted "
                         f"N={ev.get('predicted')})")
        elif kind == "migration":
            g = int(ev.get("generation", -1))
            m = rep.migrations.get(g)
            if m is None:
                m = {"generation": g, "kind": ev.get("kind"), "reason": ev.get("reason", ""),
                     "duration_s": 0.0, "transfer_s": 0.0, "bytes_moved": int(ev.get("bytes_moved", 0) or 0),
                     "step": int(ev.get("step", 0) or 0), "D": ev.get("D"), "P": ev.get("P"), "N": ev.get("N"),
                     "joiners": list(ev.get("joiners") or []), "t_end": t, "members": [], "printed": False,
                     "recovery": "recovery" in str(ev.get("reason", "")), "lost_from": None}
                if m["recovery"]:  # the job stalled from the loss (our SIGKILL, if any) until the survivors resumed
                    prev = max((x["t_end"] for x in rep.migrations.values()), default=0.0)
                    kills = [k for k in self.state.kill_times if prev <= k <= t]
                    m["lost_from"] = min(kills) if kills else self._recovering_since.get(g - 1)
                rep.migrations[g] = m
                if g > rep.egen:
                    rep.egen = g
                    rep.shapes.append({"t": t, "N": ev.get("N"), "D": ev.get("D"), "P": ev.get("P"),
                                       "generation": g, "why": ev.get("kind")})
            m["duration_s"] = max(m["duration_s"], float(ev.get("duration_s", 0.0) or 0.0))
            m["transfer_s"] = max(m["transfer_s"], float(ev.get("transfer_s", 0.0) or 0.0))
            m["t_end"] = max(m["t_end"], t)
            m["members"].append(member)
            if len(m["members"]) >= int(m["N"] or 0) - len(m["joiners"]):
                self._print_migration(m)
        elif kind == "left":
            self.say(f"{member} left ({ev.get('reason')}): handed its state over in {float(ev.get('transfer_s', 0)):.2f} s")
        elif kind == "recovering" and ev.get("generation") not in self._recoveries:
            self._recoveries.add(ev.get("generation"))
            self.say(f"sudden loss of {ev.get('dead')}: survivors {ev.get('survivors')} recover in place")

    def _print_migration(self, m: dict[str, Any]) -> None:
        if m["printed"]:
            return
        m["printed"] = True
        extra = f", joiners {m['joiners']}" if m["joiners"] else ""
        reason = m["reason"] if len(m["reason"]) <= 90 else m["reason"][:87] + "..."
        stall = f" (stalled {_lost(m):.2f} s since the loss)" if m["recovery"] else ""
        self.say(f"migration -> gen {m['generation']}: {m['kind']} to {m['D']}x{m['P']} (N={m['N']}) at step "
                 f"{m['step']} in {m['duration_s']:.2f} s{stall}, {m['bytes_moved'] / 1e6:.2f} MB moved{extra} "
                 f"[{reason}]")

    def flush_migrations(self) -> None:
        """Print every migration not printed yet (a member that never reported: what the others said)."""
        for m in self.reports.migrations.values():
            self._print_migration(m)

    def progress(self, force: bool = False, instances: int = 0) -> None:
        """Print a progress line (at most every ``--progress-every`` seconds unless ``force``).

        Args:
            force: Print now.
            instances: ``--elastic``: the instances the fleet holds now.
        """
        now = time.time()
        if not force and now - self._last_line < self.cfg.progress_every_s:
            return
        self._last_line = now
        st, rep = self.state, self.reports
        ev = rep.latest
        current = ev.get("generation") == st.generation
        rate = float(ev.get("samples_per_s", 0.0)) if current else 0.0
        if self.cfg.mode == ELASTIC:
            for m in rep.migrations.values():  # a member that never reported: print what the others said
                if not m["printed"] and now - st.t0 - m["t_end"] > 2.0:
                    self._print_migration(m)
            sh = rep.shapes[-1] if rep.shapes else None
            shape = f"{sh['D']}x{sh['P']}" if sh else "-"
            standby = sum(1 for w in self.pool.workers if w.alive() and rep.waiting(w))
            lost = sum(_lost(m) for m in rep.migrations.values())
            state = " (fallback: relaunching)" if st.fallback is not None else (
                " (starting)" if st.phase in (Phase.PENDING, Phase.STARTING) and instances else "")
            if not instances:
                state = " (paused: no instances)"
            print(f"[parcae run {now - st.t0:6.1f}s] N={instances} DxP={shape} gen={rep.egen} "
                  f"step={ev.get('step', 0)} samples/s={rate:.0f} next={self._next_change()}, "
                  f"standby={standby} migrations={len(rep.migrations)} ({lost:.1f}s lost) "
                  f"restarts={len(st.restarts)}{state}", file=self.out, flush=True)
            return
        d, p = (ev.get("D"), ev.get("P")) if current else st.shape
        state = "" if current or not self.pool.workers else " (starting)"
        lost = sum(r["lost_s"] for r in st.restarts)
        print(f"[parcae run {now - st.t0:6.1f}s] N={st.n} DxP={d}x{p} gen={st.generation} "
              f"step={ev.get('step', 0)} samples/s={rate:.0f} "
              f"restarts={len(st.restarts)} time_lost={lost:.1f}s{state}", file=self.out, flush=True)

    def _next_change(self) -> str:
        """The next planned change from the leader's latest decision ('keep' when none is pending)."""
        dec = self.reports.decision
        if not dec:
            return "-"
        pred = dec.get("predicted")
        pred_s = f" (pred N={','.join(str(c) for c in pred)})" if pred else ""
        chosen, cur = dec.get("chosen"), dec.get("current")
        if int(dec.get("generation", -1)) >= self.reports.egen and (chosen != cur or dec.get("leaving")):
            to = f"{chosen[0]}x{chosen[1]}" if chosen else "fallback"
            return f"{to}{pred_s}"
        return f"keep{pred_s}"

    def report(self) -> dict[str, Any]:
        """Write ``report.json`` (and ``report.png``) and return the report."""
        cfg, st, rep = self.cfg, self.state, self.reports
        wev = [e for e in rep.events if e.get("source") == "worker"]
        final = max((int(e.get("step", 0)) for e in wev), default=0)
        samples = max((int(e.get("samples", 0)) for e in wev), default=0)
        wall = time.time() - st.t0
        rates = [float(e["samples_per_s"]) for e in wev if e.get("event") == "progress" and e.get("samples_per_s")]
        migrations = [{"generation": m["generation"], "kind": m["kind"], "reason": m["reason"],
                       "t": m["t_end"] - m["duration_s"], "duration_s": m["duration_s"], "transfer_s": m["transfer_s"],
                       "bytes_moved": m["bytes_moved"], "step": m["step"], "D": m["D"], "P": m["P"], "N": m["N"],
                       "joiners": m["joiners"], "recovery": m["recovery"], "lost_s": _lost(m)}
                      for _, m in sorted(rep.migrations.items())]
        by_kind: dict[str, float] = {}
        for m in migrations:  # planned migrations by kind; recoveries from a sudden loss count apart
            key = "recovery" if m["recovery"] else m["kind"]
            by_kind[key] = by_kind.get(key, 0.0) + m["lost_s"]
        by_kind["restart"] = sum(r.get("lost_s", 0.0) for r in st.restarts)
        report = {
            "mode": cfg.mode,
            "command": cfg.command,
            "run_dir": str(cfg.run_dir),
            "trace": {"name": cfg.trace, "time_scale": cfg.time_scale, "interval_s": cfg.interval_s,
                      "wall_interval_s": cfg.wall_interval_s, "trace_counts": cfg.trace_counts,
                      "instances_per_interval": cfg.schedule} if cfg.trace else None,
            "static_instances": None if cfg.trace else cfg.instances,
            "timeline": st.timeline,
            "restarts": st.restarts,
            "num_restarts": len(st.restarts),
            "migrations": migrations,
            "num_migrations": len(migrations),
            "time_lost_by_kind_s": by_kind,
            "time_lost_s": sum(by_kind.values()),
            "changes": st.changes,
            "shapes": rep.shapes,
            "launches": st.launch + 1 if cfg.mode == ELASTIC else st.generation + 1,
            "final_step": final,
            "samples": samples,
            "wall_s": wall,
            "samples_per_s_overall": samples / wall if wall > 0 else 0.0,
            "samples_per_s_while_training_median": sorted(rates)[len(rates) // 2] if rates else 0.0,
            "events": rep.events,
        }
        (cfg.run_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
        if cfg.plot:
            try:
                _plot(report, cfg.run_dir / "report.png")
            except Exception as exc:  # noqa: BLE001 -- a missing matplotlib must not lose the run's report
                print(f"[parcae run] report.png not written: {exc}", file=self.out, flush=True)
        return report


def _lost(m: dict[str, Any]) -> float:
    """Time one migration cost the job: its duration, or for a recovery, from the loss until training resumed."""
    if m.get("recovery") and m.get("lost_from") is not None:
        return max(float(m["duration_s"]), float(m["t_end"]) - float(m["lost_from"]))
    return float(m["duration_s"])


_KIND_COLORS = {"intra-stage": "tab:green", "inter-stage": "tab:orange", "repartition": "tab:purple",
                "recovery": "tab:red"}


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    elastic = report.get("mode") == ELASTIC
    prog = [e for e in report["events"] if e.get("source") == "worker" and e.get("event") == "progress"]
    has_loss = any("loss" in e for e in prog)
    fig, axes = plt.subplots(4 if has_loss else 3, 1, figsize=(9, 9.5 if has_loss else 7.5), sharex=True)
    tl = report["timeline"]
    t_end = report["wall_s"]
    tr = report["trace"]
    t0 = report["events"][0]["time"] if report["events"] else 0.0
    if tr:
        xs = [k * tr["wall_interval_s"] for k in range(len(tr["instances_per_interval"]))]
        axes[0].step(xs, tr["instances_per_interval"], where="post", label="available (trace, scaled)", lw=4,
                     alpha=0.35)
    axes[0].step([e["t"] for e in tl] + [t_end], [e["N"] for e in tl] + [tl[-1]["N"] if tl else 0], where="post",
                 label="instances (processes)" if elastic else "instances in use")
    for r in report["restarts"]:
        axes[0].axvspan(r["t_request"] - t0, r["t_request"] - t0 + r["downtime_s"], color="red", alpha=0.2)
    if elastic:
        sh = report.get("shapes", [])
        if sh:
            axes[0].step([e["t"] for e in sh] + [t_end], [e["N"] for e in sh] + [sh[-1]["N"]], where="post",
                         label="members training (D x P)")
            for key in ("D", "P"):
                axes[1].step([e["t"] for e in sh] + [t_end], [e[key] for e in sh] + [sh[-1][key]], where="post",
                             label=key)
        seen: set[str] = set()
        top = max([e["N"] for e in tl] + [e["N"] or 0 for e in sh] + (tr["instances_per_interval"] if tr else []) + [1])
        axes[0].set_ylim(-0.2, top + 1.0)
        for k, m in enumerate(report.get("migrations", [])):
            kind = "recovery" if m.get("recovery") else m["kind"]
            color = _KIND_COLORS.get(kind, "black")
            label = None if kind in seen else f"migration: {kind}"
            seen.add(kind)
            for ax in axes:
                ax.axvline(m["t"], color=color, ls="--", lw=0.9, alpha=0.8)
            axes[0].plot([m["t"]], [m["N"]], marker="v", color=color, ms=8, ls="none", label=label)
            axes[0].annotate(f"{m['D']}x{m['P']} {m['lost_s']:.1f}s", (m["t"], m["N"]), textcoords="offset points",
                             xytext=(3, 6 + 9 * (k % 2)), fontsize=7, color=color)
    else:
        starts = [e for e in report["events"] if e.get("source") == "worker" and e.get("event") == "start"]
        for key in ("D", "P"):
            axes[1].step([e["time"] - t0 for e in starts] + [t_end], [e[key] for e in starts] +
                         [starts[-1][key] if starts else 0], where="post", label=key)
    axes[0].set_ylabel("instances")
    axes[0].legend(loc="best", fontsize=7)
    axes[1].set_ylabel("shape in use")
    axes[1].legend(loc="best", fontsize=8)
    for g in sorted({e.get("generation", 0) for e in prog}):  # one line per launch: no line across restarts
        pts = [e for e in prog if e.get("generation", 0) == g]
        axes[2].plot([e["time"] - t0 for e in pts], [e.get("samples_per_s", 0) for e in pts], ".-", color="C0")
        if has_loss:
            lp = [e for e in pts if "loss" in e]
            axes[3].plot([e["time"] - t0 for e in lp], [e["loss"] for e in lp], ".-", color="C1",
                         label="training loss" if g == min(e.get("generation", 0) for e in prog) else None)
    if has_loss:
        val = [e for e in report["events"] if e.get("source") == "worker" and e.get("event") == "validation"
               and "val_loss" in e.get("metrics", {})]
        if val:
            axes[3].plot([e["time"] - t0 for e in val], [e["metrics"]["val_loss"] for e in val], "s", color="C3",
                         label="validation loss")
        axes[3].set_ylabel("loss")
        axes[3].legend(loc="best", fontsize=8)
    axes[2].set_ylabel("samples/s")
    if elastic:
        axes[-1].set_xlabel("wall time (s); dashed: in-place migrations (colour = kind); red: restart downtime")
        lost = report["time_lost_by_kind_s"]
        fig.suptitle(f"parcae run --elastic: {report['num_migrations']} migrations "
                     f"({sum(v for k, v in lost.items() if k != 'restart'):.1f} s), {report['num_restarts']} "
                     f"restarts ({lost.get('restart', 0.0):.1f} s), final step {report['final_step']}")
    else:
        axes[-1].set_xlabel("wall time (s); red: restart downtime (restart fallback)")
        fig.suptitle(f"parcae run: {report['num_restarts']} restarts, {report['time_lost_s']:.1f} s lost, "
                     f"final step {report['final_step']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)

