"""Lightning's collectives under live reconfiguration: a peer lost in the middle of one never crashes or hangs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_parcae.runtime.store import host_store

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent

WORKER = r"""
import os, signal, sys, time, types
from datetime import timedelta
import torch.distributed as dist
from lightning_parcae.runtime.liveness import Liveness, activate
from lightning_parcae.runtime.store import connect_store
from lightning_parcae.training.collectives import Collectives
from lightning_parcae.training.stage_state import StageState

url, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
store = connect_store(url, token=None)
dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2,
                        timeout=timedelta(seconds=120))
live = Liveness(lambda: connect_store(url, token=None), f"m{rank}", interval_s=0.1, dead_after_s=1.5).start()
live.set_generation(0, ["m0", "m1"])
activate(live)
er = types.SimpleNamespace(live=live, joining=False, admitted=True)
coll = Collectives(StageState(), types.SimpleNamespace(elastic_runtime=er, root_device=None))
assert coll.broadcast({"log_dir": "from-1"} if rank == 1 else None, src=1) == {"log_dir": "from-1"}
if rank == 1:
    if mode == "die":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGSTOP)  # silent: alive, heartbeat and sockets still open, nothing answers
t0 = time.time()
got = coll.broadcast("mine", src=1)
print(f"RESULT {got!r} {time.time() - t0:.2f} {live.aborted.is_set()}", flush=True)
os._exit(0)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["die", "silent"])
def test_broadcast_returns_the_local_value_if_the_source_is_lost_during_it(mode: str, tmp_path: Path) -> None:
    """Regression: Lightning's broadcasts (``log_dir`` in set-up, ``ModelCheckpoint``'s paths) went through an
    unguarded ``broadcast_object_list``: a member lost during one crashed the others with "Connection closed by
    peer", and a *silent* one (a vanished machine, here SIGSTOP) left them waiting for the group timeout. Now the
    survivor returns its own value within the detection bound and the generation is aborted (the next step boundary
    recovers in place)."""
    server = host_store("tcp://127.0.0.1:0")
    url = f"tcp://127.0.0.1:{server.port}"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, url, str(r), mode], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT")]
    assert line, out[-3000:]
    _, value, seconds, aborted = line[0].split()
    assert value == "'mine'" and aborted == "True", line
    assert float(seconds) < 1.5 + 3.0, f"the survivor waited {seconds} s (detection bound 1.5 s)"
