"""Agents on N namespaced machines under a fault schedule drawn from a seed: the five-machine replay at fleet sizes.

Problem: jobs across machines were checked with 3 and 5 machines in network namespaces, each test one fixed
choreography. A fleet of 8, 12 or 16 machines walks other paths: a start-up roster that closes before every agent
has arrived (the rest wait as standbys), notices and silences of several machines at once, a recovery that leaves
a live machine without a partner (it is released and comes back as a standby), standbys that must be planned back
in, and a whole stage lost with the checkpoint writer among the silent ones. A trial here draws, from one seed, the
global batch, which members get a notice together (1-2), which go silent together (1-2), and which stage loses
every holder, and replays:

1. N-1 machines start ``parcae agent --nodes 2:N --checkpoint-dir s3://ckpt/job`` at once; the store is etcd
   started by ``parcae store start`` on a machine of its own, the checkpoints go to an S3 API server (moto) on
   another. The model needs a pipeline (a per-stage memory limit below the whole model's), so every shape has
   P >= 2 and a stage can be lost while other machines live on.
2. Once a generation trains, a notice (SIGTERM to the agent) for 1-2 members other than rank 0, at once; the N-th
   machine arrives. Once the job settles, as many live machines are seated as a shape of the running P can use
   (the largest D <= live // P that splits the global batch: with B = 24, ten machines seat 4 x 2, not 5 x 2).
3. 1-2 members go silent at once (their bridge ports down: no reset), each leaving its stage another holder; the
   survivors recover live, and the ready standbys are planned back in (the same seating check).
4. Every holder of the drawn stage goes silent at once (stage 0: rank 0, the checkpoint writer, among them): the
   remaining agents relaunch by themselves from the newest complete checkpoint in the bucket.

Checks: every remaining agent exits 0 by itself, every step 1..max_steps was trained with one global batch and
every epoch is a permutation, replicas of a stage agree, and the final parameters equal one undisturbed process's
(relative 1e-5). What the trial did, and when, is printed with each step and kept in ``result.json``.

Needs root and iproute2 (network namespaces), etcd and ``moto[server]``. Run one trial::

    .venv/bin/python tests/netns_harness.py --machines 8 --seed 1

or a family (``--seeds 1,2,3 --machines 12``); ``tests/test_netns.py`` runs one seed at 8 machines (slow).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import netns
from lightning_parcae.planning.costmodel import largest_split

from elastic_harness import JOB, ROOT, check_replicas_agree, check_samples_once, merged_final, reference

__all__ = ["NetnsTrial", "JobWatch", "TrialFailed", "draw", "run_trial", "main"]

MICRO_BATCHES = 2  # elastic_job's default --micro-batches
STEP_DELAY_S = 0.25  # each step sleeps this long (elastic_job --delay): the job outlasts the fault schedule
SETTLE_TIMEOUT_S = 120.0  # how long a released or arriving standby may take to be seated again


@dataclass(frozen=True)
class NetnsTrial:
    """One drawn trial.

    Attributes:
        seed: The seed it was drawn from (members are picked from a second stream of it while it runs).
        machines: Machines in the job (N-1 start together, the N-th arrives after the notice).
        batch: The global batch (a multiple of 24: it splits over D = 1, 2, 3, 4, 6 with M = 2).
        noticed: Members that get a notice together.
        silenced: Members that go silent together after the notice.
        stage_lost: The stage whose every holder goes silent at the end.
        max_steps: Steps the job trains (enough to outlast the schedule on 2 cores).
    """

    seed: int
    machines: int
    batch: int
    noticed: int
    silenced: int
    stage_lost: int
    max_steps: int

    def job_args(self) -> list[str]:
        """The arguments of ``tests/elastic_job.py`` (a reference run takes the same)."""
        # 8000 bytes per stage: the model's 11,552 bytes (parameters, gradients, Adam state) need P >= 2
        return ["--max-steps", str(self.max_steps), "--pipeline-stages", "2", "--interval-steps", "4", "--delay",
                str(STEP_DELAY_S), "--batch-size", str(self.batch), "--samples", str(self.batch * 20), "--ckpt-every",
                "4", "--stall-s", "60", "--max-stage-memory-bytes", "8000"]


def draw(seed: int, machines: int, max_steps: int = 700) -> NetnsTrial:
    """The trial of ``seed`` at ``machines`` machines (the draws depend on neither ``machines`` nor ``max_steps``)."""
    rng = random.Random(seed)
    return NetnsTrial(seed=seed, machines=machines, batch=rng.choice([24, 48, 72]), noticed=rng.choice([1, 2]),
                      silenced=rng.choice([1, 2]), stage_lost=rng.choice([0, 1]), max_steps=max_steps)


class TrialFailed(Exception):
    """A step of the schedule did not happen (what, and how long it was waited for)."""


class JobWatch:
    """The files a running trial writes, read while it runs: its agents, what was done and when, and waits that
    fail by name (:class:`TrialFailed`) when the job ends first or an agent not cut exits."""

    def __init__(self, out: Path, names: list[str], max_steps: int, batch: int) -> None:
        self.out, self.names, self.max_steps, self.batch = out, names, max_steps, batch
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.cut: set[str] = set()  # noticed or silenced: their agents may end at any time
        self.trace: list[str] = []
        self.t0 = time.time()

    def steps(self) -> list[dict[str, Any]]:
        return [r for f in self.out.glob("steps_*.jsonl") for r in netns.read_jsonl(f)]

    def events(self, name: str) -> list[dict[str, Any]]:
        """Machine ``name``'s worker events (its agent's ``--run-dir``)."""
        return netns.read_jsonl(self.out / name / "events.jsonl")

    def log(self, name: str) -> str:
        return (self.out / f"agent_{name}.txt").read_text(errors="replace")

    def note(self, line: str) -> None:
        text = f"{time.time() - self.t0:6.1f} s, step {max((r['step'] for r in self.steps()), default=0)}: {line}"
        self.trace.append(text)
        print(text, flush=True)

    def until(self, what: str, cond: Callable[[], bool], timeout: float = 300.0) -> None:
        """Wait for ``cond``; fail if it takes ``timeout``, the job ends first, or an agent not cut exits."""
        t_end = time.time() + timeout
        while not cond():
            if time.time() > t_end:
                raise TrialFailed(f"{what} within {timeout:g} s")
            if max((r["step"] for r in self.steps()), default=0) >= self.max_steps:
                raise TrialFailed(f"{what} before the job ended")
            ended = {n: p.returncode for n, p in self.agents.items() if n not in self.cut and p.poll() is not None}
            if ended:
                raise TrialFailed(f"{what}: agents exited {ended}")
            time.sleep(0.2)

    def machine(self, member: str) -> str:
        """The machine whose worker is ``member``."""
        return next(n for n in self.names if any(e.get("member") == member for e in self.events(n)))

    def usable(self, live: int, p: int) -> int:
        """How many of ``live`` machines a shape of ``p`` stages can seat: D x p for the largest D <= live // p
        that splits the global batch into D x M micro-batches (M = 2) -- not every machine: D = 5 cannot split 24."""
        return p * largest_split(self.batch, live // p, MICRO_BATCHES)

    def seats(self, since: int, settled: bool = False) -> tuple[int, int, dict[str, tuple[int, int]]]:
        """The newest generation (``since`` or later) that trained three steps, its first step and its machines'
        (replica, stage). ``settled``: also as many live machines seated as a shape of the running P can use
        (:meth:`usable`: standbys planned in)."""
        found: dict[str, Any] = {}

        def ready() -> bool:
            recs = [r for r in self.steps() if r["gen"] < 1000]
            gen = max((r["gen"] for r in recs), default=-1)
            mine = [r for r in recs if r["gen"] == gen]
            first = min((r["step"] for r in mine), default=0)
            if gen < since or max((r["step"] for r in mine), default=0) < first + 3:
                return False
            seated = {self.machine(r["member"]): (r["replica"], r["stage"]) for r in mine if r["step"] == first + 1}
            live = [n for n in self.agents if n not in self.cut]
            if settled and len(seated) < self.usable(len(live), 1 + max(st for _, st in seated.values())):
                return False
            found.update(gen=gen, first=first, seats=seated)
            return True

        what = f"no generation since {since} trained three steps" + (" with every usable live machine seated"
                                                                     if settled else "")
        self.until(what, ready, timeout=SETTLE_TIMEOUT_S if settled else 300.0)
        return found["gen"], found["first"], found["seats"]


def run_trial(trial: NetnsTrial, work: Path) -> dict[str, Any]:
    """Run ``trial`` in ``work`` (namespaces, store and S3 server made and removed here); return its result:
    ``problems`` (empty: passed), ``trace``, parameter difference ``rel``, ``migrations``, ``wall_s``."""
    rng = random.Random(f"members-{trial.seed}")
    out = work / "out"
    out.mkdir(parents=True)
    names = [f"a{k}" for k in range(trial.machines)]
    job = JobWatch(out, names, trial.max_steps, trial.batch)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARCAE_")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    result: dict[str, Any] = {"trial": asdict(trial), "problems": []}
    codes: dict[str, Optional[int]] = {}
    remaining: list[str] = []
    with netns.Cluster([*names, "s3"]) as cluster:
        token_file = work / "store" / "job.token"
        url, store = cluster.host_etcd(work / "store", token_file)
        s3 = cluster.host_s3("s3", bucket="ckpt")
        env.update(s3.env())

        def start(name: str) -> None:
            (out / name).mkdir(exist_ok=True)
            cmd = netns.agent_command(url, token_file, name, out / name, f"2:{trial.machines}",
                                      [sys.executable, JOB, "--out", str(out), *trial.job_args()])
            job.agents[name] = cluster.popen(name, cmd, env, out / f"agent_{name}.txt")

        try:
            for name in names[:-1]:
                start(name)
            job.note(f"started {names[:-1]}")
            gen, _, seated = job.seats(since=0)
            job.note(f"generation {gen} trains: {seated}")
            # 2. a notice for members other than rank 0, at once; the last machine arrives
            noticed = rng.sample(sorted(m for m, at in seated.items() if at != (0, 0)), trial.noticed)
            job.cut.update(noticed)
            for m in noticed:
                job.agents[m].send_signal(signal.SIGTERM)
            job.note(f"notice for {noticed} at {[seated[m] for m in noticed]}")
            start(names[-1])
            job.note(f"started {names[-1]}")
            for m in noticed:
                rc = job.agents[m].wait(timeout=180)
                if rc != 0:
                    raise TrialFailed(f"the agent of {m} exited {rc} after its notice")
            gen, first, seated = job.seats(since=gen + 1, settled=True)
            job.note(f"generation {gen} from step {first}: {seated}")
            # 3. members go silent at once, each stage keeping a holder
            quiet: list[str] = []
            for m in rng.sample(sorted(seated), len(seated)):
                others = [x for x, at in seated.items() if at[1] == seated[m][1] and x not in quiet and x != m]
                if seated[m] != (0, 0) and len(quiet) < trial.silenced and others:
                    quiet.append(m)
            job.cut.update(quiet)
            for m in quiet:
                cluster.silence(m)
            job.note(f"silenced {quiet} at {[seated[m] for m in quiet]}")
            gen, first, seated = job.seats(since=gen + 1, settled=True)
            job.note(f"generation {gen} from step {first}: {seated}")
            # 4. every holder of a stage goes silent at once, after rank 0 wrote a checkpoint of this generation
            writer = next(m for m, at in seated.items() if at == (0, 0))
            job.until(f"rank 0 ({writer}) wrote a checkpoint in generation {gen}",
                      lambda: any(e.get("event") == "checkpoint" and e["step"] >= first for e in job.events(writer)))
            lost = sorted(m for m, at in seated.items() if at[1] == trial.stage_lost)
            remaining = [n for n in names if n not in job.cut and n not in lost]
            if len(remaining) < 2:
                raise TrialFailed(f"losing {lost} would leave {remaining}: fewer than the 2 the job needs")
            job.cut.update(lost)
            for m in lost:
                cluster.silence(m)
            job.note(f"silenced stage {trial.stage_lost}'s holders {lost}; remaining {remaining}")
            codes = {n: job.agents[n].wait(timeout=600) for n in remaining}
            job.note(f"the remaining agents exited {codes}")
        except (TrialFailed, subprocess.TimeoutExpired) as e:
            result["problems"].append(str(e))
            job.note(f"FAILED: {e}")
        finally:
            netns.kill_agents(job.agents)
            store.terminate()
            store.wait(timeout=30)
            s3.stop()
    if not result["problems"]:
        result["problems"] += _check(trial, job, remaining, codes, work, result)
    moves = [e for n in names for e in job.events(n) if e.get("event") == "migration"]
    result.update(trace=job.trace, wall_s=round(time.time() - job.t0), migrations=len(moves),
                  fallbacks=sum(1 for n in names for e in job.events(n) if e.get("event") == "fallback"))
    (work / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _check(trial: NetnsTrial, job: JobWatch, remaining: list[str], codes: dict[str, Optional[int]], work: Path,
           result: dict[str, Any]) -> list[str]:
    """The end-of-trial checks (module docstring); returns what failed."""
    if codes != {n: 0 for n in remaining}:
        return [f"the remaining agents exited {codes}, not 0"]
    recs = job.steps()
    problems = []
    try:
        check_samples_once(recs, trial.max_steps, trial.batch)
        check_replicas_agree(recs)
    except AssertionError as e:
        problems.append(f"data or replicas: {e}")
    ref = reference(work / "ref", trial.job_args())
    relaunched = {r["member"] for r in recs if r["gen"] >= 1000}
    final = merged_final({f.stem[6:]: torch.load(f, weights_only=True) for f in job.out.glob("final_*.pt")
                          if f.stem[6:] in relaunched})
    if set(final) != set(ref):
        return [*problems, f"final parameters {sorted(final)} but the reference has {sorted(ref)}"]
    rel = max(float((final[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-12)) for k in ref)
    result["rel"] = rel
    if rel > 1e-5:
        problems.append(f"final parameters differ from one process's by {rel:.2e} (relative; bound 1e-5)")
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Agents on N namespaced machines under a drawn fault schedule "
                                             "(see the module docstring). Needs root, iproute2, etcd, moto[server].")
    ap.add_argument("--machines", type=int, default=8, help="machines in the job (default 8)")
    ap.add_argument("--seed", type=int, default=None, help="run one trial")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds")
    ap.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--max-steps", type=int, default=700,
                    help="steps the job trains (default 700: it outlasts the schedule at 8-16 machines on 2 cores)")
    args = ap.parse_args(argv)
    if args.machines < 5:
        ap.error(f"--machines {args.machines}: the schedule loses up to 4 machines and keeps 2; give 5 or more")
    why = netns.unavailable()
    if why is not None:
        ap.error(f"network namespaces: {why}")
    seeds = [args.seed] if args.seed is not None else [int(x) for x in (args.seeds or "1").split(",") if x.strip()]
    work = Path(args.work or tempfile.mkdtemp(prefix="parcae-netns-"))
    failed = []
    for seed in seeds:
        trial = draw(seed, args.machines, args.max_steps)
        r = run_trial(trial, work / f"seed{seed}")
        ok = not r["problems"]
        failed += [] if ok else [seed]
        print(f"[netns] seed {seed}: {'ok' if ok else 'FAILED'} in {r['wall_s']} s; N={trial.machines} "
              f"B={trial.batch}; {r['migrations']} migration events, {r['fallbacks']} fallback events; "
              f"params rel {r.get('rel', float('nan')):.1e}" + ("" if ok else f"; {r['problems']}"), flush=True)
    print(f"[netns] {len(seeds) - len(failed)} of {len(seeds)} passed; work in {work}"
          + (f"; failed seeds {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
