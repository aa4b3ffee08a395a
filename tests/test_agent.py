"""``parcae agent``: machines that share only an etcd store run one job with live reconfiguration.

Three "machines" on loopback (one agent + one worker each) against a real etcd the test starts: two start the job
(``--nodes 2``), a third is added as a joining instance (``--join``) and waits as a standby until a planning
interval admits it; once it trains, the first machine gets a preemption notice (SIGTERM to its agent, as a cloud's
shutdown hook would send). (An earlier version added the third machine mid-run; on a loaded 2-core machine its
start-up outlasted the 10 s job and it never joined.) The job must finish with the parameters of an uninterrupted run.

The whole-job fallback without a person: agents started with ``--nodes MIN:MAX`` and no ranks agree on the roster
through the store, and when a stage loses every replica (exit 75) they agree on one relaunch round from the
checkpoint and go on by themselves -- with fake workers (seconds) and with the real elastic job over etcd (slow).
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

import pytest

from elastic_harness import JOB, ROOT, check_replicas_agree, check_samples_once, merged_final, reference
from lightning_parcae.launch.agent import main as agent_main
from lightning_parcae.testing.etcd_server import EtcdServer
from lightning_parcae.runtime.store import host_store, new_token


@pytest.mark.parametrize("nodes, rank, says", [("2", "5", "--node-rank 5 needs --nodes N"),
                                               ("2:3", "0", "--node-rank 0 needs --nodes N"),
                                               ("3:2", None, "MIN:MAX"), ("x", None, "MIN:MAX")])
def test_agent_exits_2_with_a_message_if_nodes_or_node_rank_is_malformed(
        capsys: pytest.CaptureFixture[str], nodes: str, rank: Optional[str], says: str) -> None:
    how = ["--nodes", nodes] + (["--node-rank", rank] if rank is not None else [])
    assert agent_main(["--store", "tcp://127.0.0.1:9", *how, "--", "python", "x.py"]) == 2
    assert says in capsys.readouterr().err


def test_agent_exits_2_with_the_storage_message_if_the_checkpoint_dir_is_unusable(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    token = new_token()
    server = host_store("tcp://127.0.0.1:0", token=token)
    monkeypatch.setenv("PARCAE_JOB_TOKEN", token)
    assert agent_main(["--store", f"tcp://127.0.0.1:{server.port}", "--nodes", "1", "--checkpoint-dir",
                       "zz://bucket/job", "--", "python", "x.py"]) == 2
    assert "checkpoint directory 'zz://bucket/job'" in capsys.readouterr().err


def test_agent_exits_2_with_a_message_if_no_command_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert agent_main(["--store", "tcp://127.0.0.1:9", "--join"]) == 2
    assert "training command" in capsys.readouterr().err


FAKE_WORKER = r"""
import json, os, sys, time
out, env = sys.argv[1], dict(os.environ)
member = env["PARCAE_MEMBER"]
with open(os.path.join(out, f"env_{member}.json"), "w") as f:
    json.dump({k: env.get(k) for k in ("RANK", "WORLD_SIZE", "PARCAE_JOIN", "PARCAE_GENERATION_BASE",
                                       "PARCAE_RESUME_CKPT", "PARCAE_RUN_DIR", "PARCAE_ROSTER")}, f)
if env.get("PARCAE_GENERATION_BASE", "0") != "0":
    sys.exit(0)                      # the relaunch trains to the end
if env["PARCAE_JOIN"] == "1":
    time.sleep(120)                  # a standby waiting to be admitted (the agent must stop it)
time.sleep(1.0)
sys.exit(75)                         # a stage lost every replica
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_agents_without_ranks_relaunch_the_job_from_the_checkpoint_by_themselves_if_a_worker_exits_75(
        tmp_path: Path) -> None:
    """Two agents with ``--nodes 2`` (no ranks) and a ``--join`` one on a TCPStore; the fake workers of round 0
    exit 75, the standby waits. The agents must agree on relaunch round 1 (generation base 1000, the shared
    run_dir's last.ckpt), stop the standby, and all finish with 0."""
    token = new_token()
    server = host_store("tcp://127.0.0.1:0", token=token)
    url = f"tcp://127.0.0.1:{server.port}"
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "last.ckpt").write_bytes(b"x")
    worker = tmp_path / "worker.py"
    worker.write_text(FAKE_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARCAE_")}
    env.update(PARCAE_JOB_TOKEN=token, PYTHONPATH=ROOT)
    agents = {}
    for name, how in (("a", ["--nodes", "2"]), ("b", ["--nodes", "2"]), ("c", ["--join"])):
        log = open(tmp_path / f"agent_{name}.txt", "wb")
        agents[name] = subprocess.Popen(
            [sys.executable, "-m", "lightning_parcae.launch.cli", "agent", "--store", url, "--member", name,
             "--notices", "none", "--run-dir", str(tmp_path), "--settle", "0.5", *how, "--", sys.executable,
             str(worker), str(tmp_path)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        codes = {n: p.wait(timeout=90) for n, p in agents.items()}
    finally:
        for p in agents.values():
            if p.poll() is None:
                p.kill()
    logs = "\n".join(f.read_text(errors="replace")[-3000:] for f in tmp_path.glob("agent_*.txt"))
    assert codes == {"a": 0, "b": 0, "c": 0}, logs
    import json

    envs = {f.stem[4:]: json.loads(f.read_text()) for f in tmp_path.glob("env_*.json")}
    first = {m: e for m, e in envs.items() if "." not in m}
    # the rendezvous' members start as start-up candidates: their ranks come from the roster of those that arrive
    assert {m: e["PARCAE_ROSTER"] for m, e in first.items()} == {"a": "parcae/startup/0/roster",
                                                                  "b": "parcae/startup/0/roster", "c": None}
    assert all((e["RANK"], e["WORLD_SIZE"]) == ("0", "1") for e in first.values())
    assert first["c"]["PARCAE_JOIN"] == "1" and first["a"]["PARCAE_GENERATION_BASE"] is None
    again = {m: e for m, e in envs.items() if m.endswith(".1")}
    assert sorted(again) == ["a.1", "b.1", "c.1"], logs  # every live agent took part in round 1
    members = [e for e in again.values() if e["PARCAE_JOIN"] == "0"]
    assert len(members) == 2 and {e["PARCAE_ROSTER"] for e in members} == {"parcae/startup/1/roster"}
    assert {e["PARCAE_GENERATION_BASE"] for e in again.values()} == {"1000"}
    assert {e["PARCAE_RESUME_CKPT"] for e in members} == {str(tmp_path / "ckpt" / "last.ckpt")}
    assert "declared relaunch round 1" in logs and "stopping this standby worker" in logs


@pytest.mark.multiprocess
def test_agents_train_one_job_over_etcd_if_a_machine_joins_and_another_is_preempted(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    url = etcd_server.store_url("/parcae/agent-test")
    token = new_token()
    host_store(url, token=token)
    args = ["--max-steps", "60", "--pipeline-stages", "1", "--interval-steps", "2", "--delay", "0.25", "--batch-size",
            "24", "--samples", "480"]  # 24 splits over D = 1, 2 and 3
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARCAE_")}
    env.update(PARCAE_JOB_TOKEN=token, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    agents: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, *how: str) -> None:
        log = open(out / f"agent_{name}.txt", "wb")
        agents[name] = subprocess.Popen(
            [sys.executable, "-m", "lightning_parcae.launch.cli", "agent", "--store", url, "--member", name, "--notices",
             "none", "--run-dir", str(out), *how, "--", sys.executable, JOB, "--out", str(out), *args],
            env=env, stdout=log, stderr=subprocess.STDOUT)

    def reached(step: int) -> bool:
        return any(f'"step": {step},' in f.read_text() for f in out.glob("steps_*.jsonl"))

    try:
        start("a0", "--nodes", "2", "--node-rank", "0")
        start("a1", "--nodes", "2", "--node-rank", "1")
        start("a2", "--join")  # an instance added right away: a standby until a planning interval admits it
        t_end = time.time() + 120
        while not any(f.name == "steps_a2.jsonl" for f in out.glob("steps_*.jsonl")) and time.time() < t_end:
            time.sleep(0.1)
        assert reached(1), "the job never started"
        agents["a0"].send_signal(signal.SIGTERM)  # a0's machine is being preempted
        codes = {n: p.wait(timeout=180) for n, p in agents.items()}
    finally:
        for p in agents.values():
            if p.poll() is None:
                p.kill()
    logs = "\n".join(f.read_text(errors="replace")[-2000:] for f in out.glob("agent_*.txt"))
    assert codes == {"a0": 0, "a1": 0, "a2": 0}, logs
    import json

    steps = [json.loads(line) for f in out.glob("steps_*.jsonl") for line in f.read_text().splitlines()]
    assert {r["member"] for r in steps} == {"a0", "a1", "a2"}  # the joiner trained, the preempted one had trained
    assert max(r["step"] for r in steps) == 60
    check_samples_once(steps, 60, 24)
    assert check_replicas_agree(steps) > 0
    import torch

    ref = reference(tmp_path / "ref", args)
    finals = {f.stem[6:]: torch.load(f, weights_only=True) for f in out.glob("final_*.pt")}
    final = merged_final(finals)
    for k in ref:
        assert float((final[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-12)) < 1e-5, k


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_agents_with_nodes_min_max_relaunch_from_the_checkpoint_by_themselves_if_a_machine_holding_a_stage_dies(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    """Three agents with ``--nodes 2:3`` and no ranks over a real etcd: two form the job (D=1, P=2), the third
    arrives after the roster and waits as a standby. The machine holding stage 1 dies (agent and worker SIGKILLed):
    stage 1 has no live holder, the survivor's worker exits 75, and the agents -- no person, no launcher -- agree
    on relaunch round 1 from the shared run_dir's last.ckpt (the standby's worker is stopped for it), train to the
    end and exit 0, with the parameters of an undisturbed run; the steps after the checkpoint are redone (the
    newest generation's records count)."""
    out = tmp_path / "out"
    out.mkdir()
    url = etcd_server.store_url("/parcae/agent-relaunch")
    token = new_token()
    host_store(url, token=token)
    args = ["--max-steps", "30", "--pipeline-stages", "2", "--interval-steps", "0", "--delay", "0.25",
            "--batch-size", "24", "--samples", "480", "--ckpt-every", "4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARCAE_")}
    env.update(PARCAE_JOB_TOKEN=token, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    agents: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str) -> None:
        log = open(out / f"agent_{name}.txt", "wb")
        agents[name] = subprocess.Popen(
            [sys.executable, "-m", "lightning_parcae.launch.cli", "agent", "--store", url, "--member", name,
             "--notices", "none", "--run-dir", str(out), "--nodes", "2:3", "--settle", "1", "--", sys.executable,
             JOB, "--out", str(out), *args],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # a "machine": its own group

    def log(name: str) -> str:
        return (out / f"agent_{name}.txt").read_text(errors="replace")

    def max_step() -> int:
        return max((json.loads(line)["step"] for f in out.glob("steps_*.jsonl") for line in f.read_text().splitlines()
                    if line.strip()), default=0)

    def until(what: str, cond: Any, timeout: float = 180.0) -> None:
        t_end = time.time() + timeout
        while not cond():
            assert time.time() < t_end, f"{what}: " + "\n".join(log(n)[-2000:] for n in agents)
            time.sleep(0.1)

    try:
        start("a0")
        start("a1")
        until("the job never started", lambda: max_step() >= 2)
        start("a2")  # arrives after the roster: a standby of round 0
        until("a2 never became a standby", lambda: "round 0: a standby" in log("a2"))
        until("no checkpoint", lambda: (out / "ckpt" / "last.ckpt").exists() and max_step() >= 10)
        stage1 = next(n for n in ("a0", "a1") if "round 0: rank 1 of 2" in log(n))
        os.killpg(agents[stage1].pid, signal.SIGKILL)  # the machine holding stage 1 is gone, worker and agent
        agents[stage1].wait(timeout=30)
        codes = {n: p.wait(timeout=300) for n, p in agents.items() if n != stage1}
    finally:
        for p in agents.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = "\n".join(f"--- {n}\n" + log(n)[-3000:] for n in agents)
    survivor = "a1" if stage1 == "a0" else "a0"
    assert codes == {survivor: 0, "a2": 0}, logs
    assert "relaunch round 1" in log(survivor) and "round 1: rank" in log("a2"), logs
    steps = [json.loads(line) for f in out.glob("steps_*.jsonl") for line in f.read_text().splitlines()]
    assert {r["member"] for r in steps} >= {survivor, f"{survivor}.1", "a2.1"}
    assert max(r["step"] for r in steps) == 30
    assert max(r["gen"] for r in steps) >= 1000  # the relaunch's generations: base 1000, no key collisions
    check_samples_once(steps, 30, 24)
    import torch

    ref = reference(tmp_path / "ref", args)
    finals = {f.stem[6:]: torch.load(f, weights_only=True) for f in out.glob("final_*.pt")}
    final = merged_final(finals)
    assert set(final) == set(ref)
    for k in ref:
        assert float((final[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-12)) < 1e-5, k


START_UP_ARGS = ["--max-steps", "20", "--pipeline-stages", "1", "--interval-steps", "0", "--delay", "0.1",
                 "--batch-size", "24", "--samples", "480"]


def _start_up_fault(tmp_path: Path, fault: Any) -> tuple[dict[str, int], str]:
    """Three agents with ``--nodes 3`` (real workers, a TCPStore); once the rendezvous seated a2, ``fault(proc)``
    is applied to a2's agent while its worker still imports torch. Returns a0's and a1's exit codes and every
    agent's log; checks that a0 and a1 trained every step once, in round 0, to the undisturbed parameters."""
    out = tmp_path / "out"
    out.mkdir()
    token = new_token()
    server = host_store("tcp://127.0.0.1:0", token=token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARCAE_")}
    env.update(PARCAE_JOB_TOKEN=token, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    agents: dict[str, subprocess.Popen[bytes]] = {}

    def log(name: str) -> str:
        return (out / f"agent_{name}.txt").read_text(errors="replace")

    for name in ("a0", "a1", "a2"):
        agents[name] = subprocess.Popen(
            [sys.executable, "-m", "lightning_parcae.launch.cli", "agent", "--store", f"tcp://127.0.0.1:{server.port}",
             "--member", name, "--notices", "none", "--run-dir", str(out), "--nodes", "3", "--settle", "0.5", "--",
             sys.executable, JOB, "--out", str(out), *START_UP_ARGS],
            env=env, stdout=open(out / f"agent_{name}.txt", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t_end = time.time() + 120
        while "round 0: rank" not in log("a2"):
            assert time.time() < t_end and agents["a2"].poll() is None, log("a2")
            time.sleep(0.05)
        fault(agents["a2"])
        codes = {n: agents[n].wait(timeout=240) for n in ("a0", "a1")}
        codes["a2"] = agents["a2"].wait(timeout=30) if agents["a2"].poll() is not None else -1
    finally:
        for p in agents.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    logs = "\n".join(log(n)[-2500:] for n in agents)
    assert "relaunch round" not in logs and "left out ['a2']" in logs, logs
    steps = [json.loads(line) for f in out.glob("steps_*.jsonl") for line in f.read_text().splitlines()]
    assert {r["member"] for r in steps} == {"a0", "a1"} and max(r["step"] for r in steps) == 20
    check_samples_once(steps, 20, 24)
    import torch

    ref = reference(tmp_path / "ref", START_UP_ARGS)
    final = merged_final({f.stem[6:]: torch.load(f, weights_only=True) for f in out.glob("final_*.pt")})
    for k in ref:
        assert float((final[k] - ref[k]).abs().max() / (ref[k].abs().max() + 1e-12)) < 1e-5, k
    return codes, logs


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_agents_leave_a_machine_noticed_during_start_up_out_of_the_first_generation_without_a_relaunch(
        tmp_path: Path) -> None:
    """Regression (issue 20): three agents with ``--nodes 3`` agree on three members; one machine is noticed
    (SIGTERM to its agent) while the workers still import torch. Before, the two others built generation 0 with a
    rank that never came, failed, and every agent relaunched from the checkpoint (round 1). Now the rendezvous'
    members start as candidates and the agents' start-up roster holds only the workers that arrived: the noticed
    one's worker leaves at once (its agent exits 0), the other two train to the end in round 0, every step once,
    with the parameters of an undisturbed run."""
    gone_after: list[float] = []

    def notice(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        proc.wait(timeout=60)
        gone_after.append(time.time() - t0)

    codes, logs = _start_up_fault(tmp_path, notice)
    assert codes == {"a0": 0, "a1": 0, "a2": 0}, logs
    assert gone_after[0] < 15.0, f"the noticed machine took {gone_after[0]:.1f} s to leave"  # a cloud's grace: 30 s+
    rosters = {line.split("start-up roster ", 1)[1].split("]", 1)[0] + "]" for line in logs.splitlines()
               if "start-up roster " in line}
    # members in the rendezvous' slot order, whichever of a0 and a1 registered first
    assert rosters in ({"['a0', 'a1']"}, {"['a1', 'a0']"}), logs


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_agents_leave_a_machine_that_goes_silent_during_start_up_out_of_the_first_generation(tmp_path: Path) -> None:
    """Issue 20, silence instead of a notice: three agents with ``--nodes 3``; right after the rendezvous one
    machine stops answering (its agent and worker SIGSTOPped: no exit, no reset, no notice). Its agent's counter
    stands still, the other agents leave it out of the start-up roster after the silence bound, and the two others
    train to the end in round 0 with the undisturbed run's parameters."""

    def silence(proc: subprocess.Popen[bytes]) -> None:
        time.sleep(0.5)  # its worker has started importing
        os.killpg(proc.pid, signal.SIGSTOP)

    codes, logs = _start_up_fault(tmp_path, silence)
    assert (codes["a0"], codes["a1"]) == (0, 0), logs

RESTARTED_WORKER = r"""
import json, os, sys
out, env = sys.argv[1], dict(os.environ)
with open(os.path.join(out, "members.jsonl"), "a") as f:
    f.write(json.dumps({"member": env["PARCAE_MEMBER"], "join": env["PARCAE_JOIN"]}) + "\n")
sys.exit(0 if env["PARCAE_JOIN"] == "1" else 76)   # released by the new shape, then a standby the job ends
"""


def test_an_agent_restarts_a_released_worker_as_a_standby_under_a_fresh_member_id(tmp_path: Path) -> None:
    """Regression (issue 20's network-namespace test): the restarted standby kept the released worker's id, found
    it in the transition of the generation that released it and crashed (exit 1). Each worker of a round now has
    its own id (``<agent>-r<n>``), as ``parcae run`` gives restarted instances."""
    token = new_token()
    server = host_store("tcp://127.0.0.1:0", token=token)
    worker = tmp_path / "worker.py"
    worker.write_text(RESTARTED_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARCAE_")}
    env.update(PARCAE_JOB_TOKEN=token, PYTHONPATH=ROOT)
    rc = subprocess.run([sys.executable, "-m", "lightning_parcae.launch.cli", "agent", "--store",
                         f"tcp://127.0.0.1:{server.port}", "--member", "a", "--notices", "none", "--nodes", "1",
                         "--settle", "0", "--", sys.executable, str(worker), str(tmp_path)],
                        env=env, capture_output=True, text=True, timeout=60)
    assert rc.returncode == 0, rc.stderr
    seen = [json.loads(line) for line in (tmp_path / "members.jsonl").read_text().splitlines()]
    assert seen == [{"member": "a", "join": "0"}, {"member": "a-r1", "join": "1"}], rc.stderr
    assert "restarting it as a standby" in rc.stderr
