"""A miniature launcher for the live-reconfiguration tests: hosts the store, starts members, injects events.

It plays the role ``parcae run`` plays for users, but lets a test act at chosen *steps* (notice member X when the
job reaches step 5) and read what the workers recorded (``tests/elastic_job.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_parcae.runtime.store import host_store, new_token

JOB = str(Path(__file__).with_name("elastic_job.py"))
ROOT = str(Path(__file__).resolve().parents[1])


class ElasticJob:
    """Members ``m0, m1, ...`` of one job on loopback."""

    def __init__(self, out: Path, args: list[str], store_url: Optional[str] = None) -> None:
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.token = new_token()
        if store_url is None:  # a TCPStore hosted here, like `parcae run` does
            self.store = host_store("tcp://127.0.0.1:0", token=self.token)
            self.url = f"tcp://127.0.0.1:{self.store.port}"
        else:  # e.g. etcd://127.0.0.1:PORT/parcae/job (the store several machines would share)
            self.store = host_store(store_url, token=self.token)
            self.url = store_url
        self.procs: dict[str, subprocess.Popen] = {}
        self.next_id = 0
        self.launches = 0

    def _env(self, member: str, rank: int, world: int, join: bool, resume: bool) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PARCAE_", "RANK", "WORLD_SIZE", "LOCAL_"))}
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "NODE_RANK": "0", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
            "PARCAE_STORE": self.url, "PARCAE_JOB_TOKEN": self.token, "PARCAE_MEMBER": member,
            "PARCAE_JOIN": "1" if join else "0", "PARCAE_RUN_DIR": str(self.out), "OMP_NUM_THREADS": "1",
            "PARCAE_GENERATION_BASE": str(1000 * self.launches), "PYTHONPATH": ROOT,
        })
        ckpt = self.out / "ckpt" / "last.ckpt"
        if resume and ckpt.exists():
            env["PARCAE_RESUME_CKPT"] = str(ckpt)
        return env

    def _spawn(self, rank: int, world: int, join: bool, resume: bool = False) -> str:
        member = f"m{self.next_id}"
        self.next_id += 1
        log = open(self.out / f"log_{member}.txt", "wb")
        self.procs[member] = subprocess.Popen(
            [sys.executable, JOB, "--out", str(self.out), *self.args],
            env=self._env(member, rank, world, join, resume), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        return member

    def start(self, n: int, resume: bool = False) -> list[str]:
        """Start ``n`` initial members (ranks 0..n-1)."""
        members = [self._spawn(r, n, join=False, resume=resume) for r in range(n)]
        self.launches += 1
        return members

    def add(self) -> str:
        """Start one joiner (a new instance)."""
        return self._spawn(0, 1, join=True)

    def notice(self, member: str) -> None:
        self.procs[member].send_signal(signal.SIGTERM)

    def kill(self, member: str) -> None:
        self.procs[member].send_signal(signal.SIGKILL)
        self.procs[member].wait()

    def steps(self) -> list[dict[str, Any]]:
        recs = []
        for f in self.out.glob("steps_*.jsonl"):
            for line in f.read_text().splitlines():
                if line.strip():
                    recs.append(json.loads(line))
        return recs

    def max_step(self) -> int:
        return max((r["step"] for r in self.steps()), default=0)

    def slowest_step(self) -> int:
        """The step every running member that trains has recorded (a member killed right after another one
        recorded step s may have committed s without recording it: the sample check would then miss its part)."""
        per: dict[str, int] = {}
        for r in self.steps():
            m = r.get("member")
            if m is not None:
                per[m] = max(per.get(m, 0), r["step"])
        running = [m for m in per if m in self.procs and self.procs[m].poll() is None
                   and not _stopped(self.procs[m].pid)]
        return min((per[m] for m in running), default=self.max_step())

    def wait_step(self, step: int, timeout: float = 120.0) -> None:
        """Wait until every running member has recorded ``step``.

        Regression: waiting for the first member to record it let the etcd test kill m1 between its commit of
        step 5 and its record of it; the check then found 16 of the 24 samples of a step that had been applied.
        """
        t_end = time.time() + timeout
        while self.slowest_step() < step:
            if time.time() > t_end:
                raise TimeoutError(f"job did not reach step {step}: {self.tail()}")
            if all(p.poll() is not None for p in self.procs.values()):
                raise RuntimeError(f"every worker exited before step {step}: {self.tail()}")
            time.sleep(0.05)

    def wait(self, timeout: float = 180.0) -> dict[str, int]:
        t_end = time.time() + timeout
        for m, p in self.procs.items():
            try:
                p.wait(timeout=max(1.0, t_end - time.time()))
            except subprocess.TimeoutExpired:
                self.stop()
                raise TimeoutError(f"{m} did not finish: {self.tail()}") from None
        return {m: p.returncode for m, p in self.procs.items()}

    def alive(self) -> list[str]:
        return [m for m, p in self.procs.items() if p.poll() is None]

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def tail(self, lines: int = 30) -> str:
        out = []
        for f in sorted(self.out.glob("log_*.txt")):
            text = f.read_text(errors="replace").splitlines()
            out.append(f"--- {f.name}\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def events(self) -> list[dict[str, Any]]:
        path = self.out / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def finals(self) -> dict[str, dict[str, torch.Tensor]]:
        return {f.stem[len("final_"):]: torch.load(f, weights_only=True) for f in self.out.glob("final_*.pt")}


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP): a frozen member records nothing until it wakes, so waiting for it to
    reach a step would wait for ever (regression: the fencing test froze a member and then waited for step 9)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def reference(out: Path, args: list[str]) -> dict[str, torch.Tensor]:
    """Train the same job in one plain Lightning process; its final parameters."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for k in list(env):
        if k.startswith("PARCAE_"):
            env.pop(k)
    subprocess.run([sys.executable, JOB, "--out", str(out), "--reference", *args], env=env, check=True,
                   capture_output=True, timeout=300)
    return torch.load(out / "reference.pt", weights_only=True)


def merged_final(finals: dict[str, dict[str, torch.Tensor]], stack: str = "net") -> dict[str, torch.Tensor]:
    """Global parameters from the members' final (partial) state dicts; replicas must agree (checked by caller)."""
    out: dict[str, torch.Tensor] = {}
    for sd in finals.values():
        for k, v in sd.items():
            out.setdefault(k, v)
    return out


def check_samples_once(steps: list[dict[str, Any]], max_step: int, batch: int,
                       unrecorded: Optional[dict[int, int]] = None) -> list[int]:
    """Sample ids of every committed step, in step order; each step must hold exactly one global batch.

    A step can be recorded by more than one generation only if it was redone after a fallback restart; the
    newest generation's records count (generation numbers grow across restarts). ``unrecorded`` maps a step to
    the number of its samples whose record is known to be missing (a member SIGKILLed after the step's gradient
    exchange but before it wrote its record; the caller checks the parameters, which such a step must not change).
    """
    newest: dict[int, int] = {}
    for r in steps:
        if "ids" in r:
            newest[r["step"]] = max(newest.get(r["step"], -1), r["gen"])
    ids: list[int] = []
    for step in range(1, max_step + 1):
        per = {r["replica"]: r["ids"] for r in steps if "ids" in r and r["step"] == step and r["gen"] == newest.get(step)}
        got = sorted(i for part in per.values() for i in part)
        expected = batch - (unrecorded or {}).get(step, 0)
        assert len(got) == expected, f"step {step}: {len(got)} samples recorded, expected {batch}: {per}"
        ids.extend(got)
    return ids


def check_replicas_agree(steps: list[dict[str, Any]]) -> int:
    """Every (step, stage, generation) has one parameter digest across replicas; returns the number checked."""
    seen: dict[tuple[int, int, int], dict[str, float]] = {}
    checked = 0
    for r in steps:
        key = (r["step"], r["stage"], r["gen"])
        if key in seen:
            a, b = seen[key], r["digest"]
            assert a.keys() == b.keys(), f"step {r['step']} stage {r['stage']}: replicas hold different layers"
            for k in a:
                assert abs(a[k] - b[k]) <= 1e-5 * (1 + abs(a[k])), f"step {r['step']}: replicas differ on {k}"
            checked += 1
        else:
            seen[key] = r["digest"]
    return checked
