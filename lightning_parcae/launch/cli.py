"""The ``parcae`` command: ``simulate``, ``predict``, ``run``, ``agent`` and ``store start|init|status``.

Problem: a user's first questions come before any code is written -- "on a trace like mine, what would each
policy train and cost?" (``parcae simulate``), "how predictable is my availability?" (``parcae predict``) -- and
the next one is "run it" (``parcae run``). Each sub-command validates its options and prints a clear error
(exit code 2) instead of a traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from lightning_parcae.errors import ParcaeError

__all__ = ["main", "build_parser"]

_POLICY_DEFAULT = "ideal,throughput,restart,live-reactive,parcae,parcae-oracle"


def _load_trace(spec: str, interval_s: Optional[float]):  # type: ignore[no-untyped-def]
    """Load ``spec`` at ``interval_s`` (``None``: the file's own grid, else 60 s); warn on stderr when resampling."""
    from lightning_parcae.signals.traces import BUNDLED_TRACES, bundled_trace_path, load_trace

    path = bundled_trace_path(spec) if spec in BUNDLED_TRACES else spec
    trace = load_trace(path, interval_s=60.0 if interval_s is None else interval_s)
    native = trace.native_interval_s
    if interval_s is None and native is not None and native != trace.interval_s:
        trace = load_trace(path, interval_s=native)
    elif native is not None and native != trace.interval_s:
        print(
            f"warning: {spec}: the file's times fall on a {native:g}-s grid but --interval {trace.interval_s:g} is "
            f"used, so the trace is resampled; pass --interval {native:g} (or omit --interval) to use its own",
            file=sys.stderr,
        )
    return trace


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``parcae`` (sub-commands ``simulate``, ``predict``, ``run``)."""
    from lightning_parcae.planning.costmodel import reference_models

    p = argparse.ArgumentParser(
        prog="parcae",
        description="Proactive, liveput-optimized training on preemptible instances (Parcae, NSDI '24).",
    )
    sub = p.add_subparsers(dest="command", metavar="{simulate,predict,run,agent,store}")
    sub.required = True
    trace_help = "a trace file (events CSV, counts CSV, segment JSON lines, SkyPilot JSON) or a bundled name: p3, hh_55_65, hl_15_25, lh_80_90, ll_10_11"

    s = sub.add_parser(
        "simulate",
        help="compare policies on an availability trace",
        description="Replay a trace through each policy with the same cost model and print samples trained, "
        "throughput, reconfigurations, time lost and dollars per policy.",
    )
    s.add_argument("--trace", default="p3", help=trace_help + " (default: p3)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--model-table", default=None, help=f"a bundled profiled table: {', '.join(reference_models())} (default: gpt-1.5b)")
    g.add_argument("--profile", default=None, help="a per-layer profile JSON (see docs/planner.md)")
    s.add_argument("--policy", default=_POLICY_DEFAULT, help=f"comma-separated policies (default: {_POLICY_DEFAULT})")
    s.add_argument("--max-instances", type=int, default=None,
                   help="scale the trace's counts so that its peak is this many instances, as `parcae run "
                   "--max-instances` replays it (e.g. to price a run's profile.json on the cluster it ran on)")
    s.add_argument("--look-ahead", type=int, default=12, help="intervals the parcae policies plan over (default 12)")
    s.add_argument("--risk", type=float, default=None,
                   help="standard deviations of expected gain the parcae policy's departure from reacting must clear "
                        "(default 1, as ParcaeStrategy(risk=...); 0 follows the forecast's expectation)")
    s.add_argument("--min-gain", type=float, default=None,
                   help="the least fraction of the reactive plan's expected value a parcae departure must gain besides "
                        "the risk rule, in [0, 1) (default 0.01, as ParcaeStrategy(min_gain=...); 0: none)")
    s.add_argument("--charge-unmeasured", action=argparse.BooleanOptionalAction, default=True,
                   help="a parcae departure to a shape the --profile has not measured must also clear the fit's "
                        "error (default on, as ParcaeStrategy(charge_unmeasured=True))")
    s.add_argument("--predictor", default="persistence", help="predictor of the parcae policy: persistence (default), arima, artifact, hazard, ensemble")
    s.add_argument("--cost-model", default="artifact", choices=["artifact", "default"], help="artifact: the Parcae artifact's accounting (needs --model-table); default: our runtime's costs")
    s.add_argument("--preemption-notice", action=argparse.BooleanOptionalAction, default=None,
                   help="--cost-model default: departures come with a notice and the leavers hand their state over, "
                   "so no departure forces a checkpoint restart -- as the runtime prices them (ParcaeStrategy("
                   "preemption_notice=True), the default). Default: on with --cost-model default; "
                   "--no-preemption-notice prices every departure as a sudden loss (instances that vanish)")
    s.add_argument("--price", type=float, default=0.918, help="USD per instance-hour (default 0.918: p3.2xlarge at a 70%% spot discount)")
    s.add_argument("--interval", type=float, default=None, help="interval length in seconds (default: the trace file's own grid, e.g. 300 for a 5-minute trace; 60 if it has none)")
    s.add_argument("--start-hour", type=float, default=0.0, help="simulate from this hour of the trace")
    s.add_argument("--end-hour", type=float, default=None, help="simulate up to this hour of the trace")
    s.add_argument("--report", default=None, help="write the JSON report here")
    s.add_argument("--plot", default=None, help="write a PNG (availability, D x P, cumulative samples) here")

    q = sub.add_parser(
        "predict",
        help="score the availability predictors on a trace",
        description="Walk the trace online and print the mean absolute error of each predictor per horizon step.",
    )
    q.add_argument("--trace", default="p3", help=trace_help)
    q.add_argument("--horizon", type=int, default=12, help="forecast steps (default 12)")
    q.add_argument("--interval", type=float, default=None, help="interval length in seconds (default: the trace file's own grid, e.g. 300 for a 5-minute trace; 60 if it has none)")
    q.add_argument("--predictors", default=None, help="comma-separated names (default: all)")
    q.add_argument("--min-instances", type=int, default=0, help="lowest count a forecast may take (default 0)")
    q.add_argument(
        "--max-instances", type=int, default=None, help="highest count a forecast may take (default: no limit)"
    )

    r = sub.add_parser(
        "run",
        help="run a training script on a one-machine cluster (optionally replaying a trace)",
        description="Start a loopback coordination store and N worker processes; see docs/run.md. "
        "Everything after -- is the training command.",
        add_help=False,
    )
    r.add_argument("args", nargs=argparse.REMAINDER)

    a = sub.add_parser(
        "agent",
        help="run this machine's worker of a multi-machine job (shared etcd/TCP store)",
        description="One agent per machine: connect to the shared store, agree on ranks with the other agents "
        "(--nodes MIN:MAX) or take a fixed one, start the training script, forward preemption notices, and relaunch "
        "from the newest checkpoint when a stage is lost; see docs/cloud.md.",
        add_help=False,
    )
    a.add_argument("args", nargs=argparse.REMAINDER)

    st = sub.add_parser(
        "store",
        help="the shared store of a multi-machine job: `parcae store start` (etcd + job token + proof), "
        "`parcae store init` (token and proof for an existing store), `parcae store status`",
        description="parcae store start [--listen HOST:PORT] [--data-dir D] [--token-file F] | parcae store init "
        "--store etcd://HOST:2379/parcae/JOB --token-file F | parcae store status --store URL [--token-file F]; "
        "see docs/cloud.md.",
        add_help=False,
    )
    st.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _simulate(a: argparse.Namespace) -> int:
    from lightning_parcae.planning.measured import load_cost_model
    from lightning_parcae.errors import ConfigurationError
    from lightning_parcae.planning.shape_optimizer import check_min_gain
    from lightning_parcae.planning.sim import simulate

    if a.look_ahead < 1:
        raise ConfigurationError(f"--look-ahead {a.look_ahead}: plan over at least 1 interval")
    model = a.model_table if (a.model_table or a.profile) else "gpt-1.5b"
    if a.profile and a.cost_model == "artifact":
        raise ConfigurationError("--profile works with --cost-model default (the artifact's accounting needs one of its tables)")
    trace = _load_trace(a.trace, a.interval)
    if a.start_hour or a.end_hour is not None:
        trace = trace.slice(a.start_hour * 3600.0, None if a.end_hour is None else a.end_hour * 3600.0)
        if len(trace) == 0:
            raise ConfigurationError(f"--start-hour {a.start_hour} / --end-hour {a.end_hour} select no interval of {a.trace}")
    if a.max_instances is not None:
        from lightning_parcae.signals.traces import scaled

        if a.max_instances < 1:
            raise ConfigurationError(f"--max-instances {a.max_instances}: scale the trace to at least 1 instance")
        trace = scaled(trace, a.max_instances)
    notice = a.cost_model == "default" if a.preemption_notice is None else a.preemption_notice
    cm = load_cost_model(a.cost_model, model=None if a.profile else model, profile_path=a.profile,
                         preemption_notice=notice)
    policies = [x.strip() for x in a.policy.split(",") if x.strip()]
    settings = {"model": model if not a.profile else a.profile, "cost_model": a.cost_model, "trace": a.trace,
                "preemption_notice": notice}
    comp = simulate(trace, cm, policies, look_ahead=a.look_ahead, predictor=a.predictor, price=a.price, settings=settings,
                    risk=a.risk, min_gain=None if a.min_gain is None else check_min_gain(a.min_gain, "--min-gain"),
                    charge_unmeasured=a.charge_unmeasured)
    print(
        f"trace {a.trace}: {len(trace)} intervals of {trace.interval_s:g} s, up to {trace.max_n} instances; "
        f"model {settings['model']}; cost model {a.cost_model}"
        f"{' (departures noticed)' if notice else ''}; look-ahead {a.look_ahead}; predictor {a.predictor}; "
        f"risk {comp.settings['risk']:g}; least gain {comp.settings['min_gain']:g}"
        f"{'' if a.charge_unmeasured else '; fit error not charged'}"
    )
    print(comp.table())
    if a.report:
        comp.save_json(a.report)
        print(f"report: {a.report}")
    if a.plot:
        comp.plot(a.plot)
        print(f"plot: {a.plot}")
    return 0


def _predict(a: argparse.Namespace) -> int:
    from lightning_parcae.errors import ConfigurationError
    from lightning_parcae.planning.forecast import PREDICTORS, format_mae_table, mae_table

    if a.horizon < 1:
        raise ConfigurationError(f"--horizon {a.horizon}: forecast at least 1 step")
    if a.interval is not None and not a.interval > 0:
        raise ConfigurationError(f"--interval {a.interval}: the interval must be a positive number of seconds")
    if a.min_instances < 0 or (a.max_instances is not None and a.max_instances < a.min_instances):
        raise ConfigurationError(
            f"--min-instances {a.min_instances} / --max-instances {a.max_instances}: need 0 <= min <= max"
        )
    names = [x.strip() for x in a.predictors.split(",")] if a.predictors else list(PREDICTORS)
    unknown = [n for n in names if n not in PREDICTORS]
    if unknown:
        raise ConfigurationError(f"unknown predictors {unknown}: choose from {', '.join(PREDICTORS)}")
    trace = _load_trace(a.trace, a.interval)
    if len(trace) < 2:
        raise ConfigurationError(
            f"{a.trace}: {len(trace)} interval(s) of {trace.interval_s:g} s is too short to score a forecast: "
            "scoring needs at least 2 intervals (one observed, one to compare with); use a longer trace or a "
            "shorter --interval"
        )
    table = mae_table(
        trace.counts(), [a.horizon], names=names, min_instances=a.min_instances, max_instances=a.max_instances
    )
    bounds = f"[{a.min_instances}, {'no limit' if a.max_instances is None else a.max_instances}]"
    print(
        f"trace {a.trace}: {len(trace)} intervals of {trace.interval_s:g} s, up to {trace.max_n} instances; "
        f"forecasts kept in {bounds}; mean absolute error (instances) over steps 1..{a.horizon}"
    )
    print(format_mae_table(table))
    return 0


def _run(a: argparse.Namespace) -> int:
    try:
        from lightning_parcae.launch import run as run_mod
    except ImportError as e:  # pragma: no cover - the launcher ships with the package
        print(f"parcae run is unavailable: {e}", file=sys.stderr)
        return 2
    return int(run_mod.main(a.args) or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``parcae`` console script.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code (2 for a configuration error).
    """
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if args and args[0] == "run":
        ns = argparse.Namespace(args=args[1:])
        handler = _run
    elif args[:2] == ["store", "init"]:
        from lightning_parcae.launch.store_init import main as store_init_main

        return store_init_main(args[2:])
    elif args[:2] == ["store", "start"]:
        from lightning_parcae.launch.store_start import start_main

        return start_main(args[2:])
    elif args[:2] == ["store", "status"]:
        from lightning_parcae.launch.store_start import status_main

        return status_main(args[2:])
    elif args and args[0] == "store":
        asked = args[1:2] in (["-h"], ["--help"])
        print("parcae store: choose a sub-command: `parcae store start` (run etcd with the token and its proof), "
              "`parcae store init` (a token for an existing store) or `parcae store status` (what the store holds); "
              "each has --help", file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    elif args and args[0] == "agent":
        from lightning_parcae.launch.agent import main as agent_main

        return agent_main(args[1:])
    else:
        ns = parser.parse_args(args)
        handler = {"simulate": _simulate, "predict": _predict, "run": _run}[ns.command]
    try:
        return handler(ns)
    except ParcaeError as e:
        print(f"parcae {args[0] if args else ''}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
