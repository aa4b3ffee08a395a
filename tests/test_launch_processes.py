"""The one worker environment of ``parcae run`` (elastic and restart fallback) and ``parcae agent``."""

from __future__ import annotations

from lightning_parcae.contract import MEMBER_ENV, RESUME_ENV, RUN_DIR_ENV, STORE_ENV
from lightning_parcae.launch.processes import worker_environment


def test_worker_environment_drops_stray_parcae_variables_of_the_launchers_shell() -> None:
    """Regression: the restart fallback built its workers' environment from the launcher's own minus three names,
    so a ``PARCAE_MEMBER`` or ``PARCAE_RUN_DIR`` left in the user's shell reached every worker."""
    base = {"PATH": "/bin", MEMBER_ENV: "stray", RUN_DIR_ENV: "/elsewhere", RESUME_ENV: "/old.ckpt"}
    env = worker_environment(base, rank=1, world=4, local_rank=2, local_world=4, master_port=1234,
                             parcae={STORE_ENV: "tcp://127.0.0.1:1"})
    assert MEMBER_ENV not in env and RUN_DIR_ENV not in env and RESUME_ENV not in env
    assert env[STORE_ENV] == "tcp://127.0.0.1:1" and env["PATH"] == "/bin"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["MASTER_PORT"]) == \
        ("1", "4", "2", "4", "1234")
    assert env["OMP_NUM_THREADS"] == "1"  # the workers of one machine share its cores


def test_worker_environment_keeps_only_named_variables_and_leaves_threads_alone_on_own_machine() -> None:
    base = {RESUME_ENV: "/ckpt", MEMBER_ENV: "stray", "OMP_NUM_THREADS": "8"}
    env = worker_environment(base, rank=0, world=1, local_rank=0, local_world=1, master_port=29500,
                             parcae={MEMBER_ENV: "host-1"}, keep=(RESUME_ENV,), shared_machine=False)
    assert env[RESUME_ENV] == "/ckpt" and env[MEMBER_ENV] == "host-1" and env["OMP_NUM_THREADS"] == "8"
    assert "OMP_NUM_THREADS" not in worker_environment({}, rank=0, world=1, local_rank=0, local_world=1,
                                                       master_port=1, parcae={}, shared_machine=False)


def test_a_failure_carries_the_tail_of_each_workers_log(tmp_path) -> None:
    from launch_fakes import worker

    from lightning_parcae.launch.processes import RunFailed, WorkerPool

    w = worker("i0", returncode=1, log_dir=tmp_path)
    w.log_path.write_text("\n".join(f"line {k}" for k in range(40)) + "\nTraceback: boom\n")
    err = WorkerPool().failure("parcae run failed: worker i0 exited with 1", [w])
    assert isinstance(err, RunFailed)
    text = str(err)
    assert text.startswith("parcae run failed") and "Traceback: boom" in text and "(exit 1)" in text
    assert "line 15\n" not in text and "line 16\n" in text  # the last 25 lines only


def test_kill_all_stops_every_process_group(tmp_path) -> None:
    import sys

    from lightning_parcae.launch.processes import Worker, WorkerPool, start_worker_process

    pool = WorkerPool()
    for k in range(2):
        log = tmp_path / f"w{k}.log"
        proc = start_worker_process([sys.executable, "-c", "import time; time.sleep(60)"], {}, log)
        pool.workers.append(Worker(k, proc, log))
    pool.kill_all()
    assert all(not w.alive() for w in pool.workers)
    pool.kill_all()  # idempotent
