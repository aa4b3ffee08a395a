"""``parcae agent``: machines that share only an etcd store run one job with live reconfiguration.

Three "machines" on loopback (one agent + one worker each) against a real etcd the test starts: two start the job
(``--nodes 2``), a third is added as a joining instance (``--join``) and waits as a standby until a planning
interval admits it; once it trains, the first machine gets a preemption notice (SIGTERM to its agent, as a cloud's
shutdown hook would send). (An earlier version added the third machine mid-run; on a loaded 2-core machine its
start-up outlasted the 10 s job and it never joined.) The job must finish with the parameters of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_harness import JOB, ROOT, check_replicas_agree, check_samples_once, merged_final, reference
from lightning_parcae.launch.agent import main as agent_main
from lightning_parcae.testing.etcd_server import EtcdServer
from lightning_parcae.runtime.store import host_store, new_token


def test_agent_exits_2_with_a_message_if_node_rank_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    assert agent_main(["--store", "tcp://127.0.0.1:9", "--nodes", "2", "--", "python", "x.py"]) == 2
    assert "--node-rank" in capsys.readouterr().err


def test_agent_exits_2_with_a_message_if_no_command_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert agent_main(["--store", "tcp://127.0.0.1:9", "--join"]) == 2
    assert "training command" in capsys.readouterr().err


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
