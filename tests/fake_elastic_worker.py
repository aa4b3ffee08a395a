"""A stand-in for an elastic training worker: speaks ``parcae run``'s protocol without torch (starts in ~50 ms).

It lets the launcher's tests script exact situations (a member released with exit 76, a stage lost so that every
member exits 75, a standby that waits until the job ends) and check what the launcher does, deterministically and
fast. It writes what the real runtime writes to ``run_dir/events.jsonl``:

* a start-up candidate (``PARCAE_ROSTER`` set): an elastic ``arrived`` event, then it waits for the launcher's
  ``roster`` event of its launch (the real worker reads the signed roster from the store; this one has no torch to
  reach it) and takes its rank from it -- or, left out of it, behaves as a joiner;
* an initial member: an elastic ``phase`` event (starting -> training), then, as rank 0, worker ``progress`` events
  every ``--step-s`` (one step each), a ``checkpoint`` event (and a ``ckpt/last.ckpt`` file) every 5 steps, and
  ``end`` at ``--steps`` (then it marks the job finished in ``run_dir/finished`` and exits 0);
* a joiner (``PARCAE_JOIN=1``): a ``phase`` event (starting -> standby), then waits until the job is finished;
* SIGTERM (a notice): an elastic ``left`` event and exit 0.

``--release MEMBER@STEP[:CODE],...`` makes MEMBER exit 76 (or CODE, e.g. 77: fenced) once the job reaches STEP;
``--fallback-at STEP`` makes every member of the first launch exit 75 at STEP; ``--startup-s S`` makes the first
launch's candidates take S seconds to arrive (``--slow MEMBER@S,...``: that member S seconds instead);
``--formation-s S`` makes the first launch's roster members take S seconds from the roster to their first phase
(generation 0 forming); ``--fallback-below N`` makes every member of the first launch exit 75 once the launcher
removed instances down to fewer than N, with the fallback event the real runtime writes then ("no shape fits",
``min_instances`` N). Each process records its environment (and, as a candidate, the rank and world the roster
gave it) in ``run_dir/env_<member>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--release", default="")
    ap.add_argument("--fallback-at", type=int, default=0)
    ap.add_argument("--startup-s", type=float, default=0.0,
                    help="candidates of the first launch take this long to arrive (imports, as in a real start-up)")
    ap.add_argument("--slow", default="", help="MEMBER@S,...: that candidate of the first launch takes S seconds")
    ap.add_argument("--fallback-below", type=int, default=0,
                    help="first launch: fall back (exit 75, min_instances N) once the trace leaves fewer than N")
    ap.add_argument("--formation-s", type=float, default=0.0,
                    help="first-launch members take this long from the roster to their first phase")
    args = ap.parse_args()
    run = os.environ["PARCAE_RUN_DIR"]
    member = os.environ["PARCAE_MEMBER"]
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    joiner = os.environ.get("PARCAE_JOIN") == "1"
    launch = int(os.environ.get("PARCAE_GENERATION", "0"))
    base = int(os.environ["PARCAE_GENERATION_BASE"])
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PARCAE_JOIN", "PARCAE_ELASTIC",
            "PARCAE_GENERATION_BASE", "PARCAE_RESUME_CKPT", "PARCAE_INTERVAL_S", "PARCAE_STORE", "PARCAE_MEMBER",
            "PARCAE_ROSTER")
    recorded = {k: os.environ.get(k) for k in keys}

    def record_env() -> None:
        with open(os.path.join(run, f"env_{member}.json"), "w") as f:
            json.dump(recorded, f)

    record_env()

    def event(**e: object) -> None:
        line = (json.dumps({"time": time.time(), **e}) + "\n").encode()
        fd = os.open(os.path.join(run, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, line)
        os.close(fd)

    def on_term(signum: int, frame: object) -> None:
        event(source="elastic", event="left", member=member, generation=base, reason="notice", transfer_s=0.0)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    finished = os.path.join(run, "finished")
    step_file = os.path.join(run, "step")
    slow = {m: float(s) for m, s in (x.split("@") for x in args.slow.split(",") if x)}
    if os.environ.get("PARCAE_ROSTER") and not joiner:
        if launch == 0 and (args.startup_s or member in slow):
            time.sleep(slow.get(member, args.startup_s))  # importing: nothing of it reaches the launcher meanwhile
        event(source="elastic", event="arrived", member=member, generation=-1, roster=os.environ["PARCAE_ROSTER"])
        roster = wait_roster(run, launch)
        if member in roster["members"]:
            rank, world = roster["members"].index(member), len(roster["members"])
            if launch == 0 and args.formation_s:
                time.sleep(args.formation_s)  # generation 0 forming: groups, partition, the boot record
        else:
            joiner = True
        recorded.update(roster_rank=rank if not joiner else None, roster_world=world if not joiner else None)
        record_env()
    if joiner:
        event(source="elastic", event="phase", member=member, generation=-1, old="starting", new="standby")
        while not os.path.exists(finished):
            time.sleep(0.05)
        event(source="elastic", event="standby_exit", member=member, generation=-1, reason="job finished")
        sys.exit(0)
    event(source="elastic", event="phase", member=member, generation=base, old="starting", new="training",
          D=world, P=1)
    step = 0
    if os.environ.get("PARCAE_RESUME_CKPT"):
        with open(os.environ["PARCAE_RESUME_CKPT"]) as f:
            step = int(f.read())
    release = {m: (int(at.split(":")[0]), int((at + ":76").split(":")[1]))
               for m, at in (x.split("@") for x in args.release.split(",") if x)}
    while True:
        time.sleep(args.step_s)
        if rank == 0:
            step += 1
            with open(step_file + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(step_file + ".tmp", step_file)
            event(source="worker", event="progress", generation=launch, step=step, samples=64 * step,
                  samples_per_s=640.0, D=world, P=1, N=world)
            if step % 5 == 0:
                os.makedirs(os.path.join(run, "ckpt"), exist_ok=True)
                with open(os.path.join(run, "ckpt", "last.ckpt"), "w") as f:
                    f.write(str(step))
                event(source="worker", event="checkpoint", generation=launch, step=step, D=world, P=1)
        else:
            try:
                with open(step_file) as f:
                    step = int(f.read())
            except (OSError, ValueError):
                pass
        if member in release and step >= release[member][0]:
            sys.exit(release[member][1])
        if args.fallback_below and launch == 0 and fewer_than(run, args.fallback_below):
            event(source="elastic", event="fallback", member=member, generation=base, step=step,
                  reason=f"preemption notice: no shape fits (the model needs at least {args.fallback_below})",
                  min_instances=args.fallback_below, checkpoint="ckpt/last.ckpt")
            sys.exit(75)
        if args.fallback_at and launch == 0 and step >= args.fallback_at:
            event(source="elastic", event="fallback", member=member, generation=base,
                  reason="stage 0 lost every replica", step=step)
            sys.exit(75)
        if step >= args.steps:
            if rank == 0:
                event(source="worker", event="end", generation=launch, step=step, samples=64 * step, D=world, P=1)
                open(finished, "w").close()
            sys.exit(0)


def fewer_than(run: str, n: int) -> bool:
    """Whether the launcher has removed instances down to fewer than ``n`` (a ``remove`` event in the log)."""
    try:
        with open(os.path.join(run, "events.jsonl")) as f:
            return any(e.get("source") == "launcher" and e.get("event") == "remove" and e.get("new_N", n) < n
                       for e in (json.loads(line) for line in f if line.strip()))
    except (OSError, ValueError):
        return False


def wait_roster(run: str, launch: int) -> dict:
    """The launcher's ``roster`` event of ``launch`` (polled from the event log)."""
    path = os.path.join(run, "events.jsonl")
    while True:
        try:
            with open(path) as f:
                for line in f:
                    try:
                        e = json.loads(line)
                    except ValueError:
                        continue
                    if e.get("source") == "launcher" and e.get("event") == "roster" and e.get("launch") == launch:
                        return e
        except OSError:
            pass
        time.sleep(0.05)


if __name__ == "__main__":
    main()
