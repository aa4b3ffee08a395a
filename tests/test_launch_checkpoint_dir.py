"""``parcae run --checkpoint-dir``: the fallback's checkpoint lives off the instances, and the relaunch finds it.

Regression (issue 20): the checkpoint a whole-stage loss restarts from was ``run_dir/ckpt/last.ckpt`` on the disk of
whichever member was rank 0 -- a spot instance like the rest. Here the checkpoints go to an S3 bucket (moto's real
S3 API server on loopback, in its own process), the leader of a D = 1 pipeline is killed from outside (its stage
has no other replica: the job must restart), and the relaunch resumes from the newest complete checkpoint in the
bucket -- with the parameters of the undisturbed run, every step trained, no sample lost or repeated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from chaos_harness import Trial, run_trial
from lightning_parcae.launch.run import main
from lightning_parcae.runtime.checkpoint_store import CheckpointStore
from lightning_parcae.testing.s3_server import S3Server, moto_server_binary

pytestmark = pytest.mark.skipif(moto_server_binary() is None, reason="needs moto[server] and s3fs (the test extra)")



@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_lost_stage_relaunches_from_the_newest_checkpoint_in_s3(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    with S3Server() as s3:
        s3.create_bucket("parcae-ckpt")
        trial = Trial(seed=900, instances=1, batch=24, samples=24 * 4, pipeline_stages=1, micro_batches=2,
                      schedule="1f1b", optimizer="adam", val_every=0, after_fit=False, max_steps=24,
                      faults=[{"kind": "leader", "step": 14, "pick": 0.0}])
        result = run_trial(trial, tmp_path, launcher_args=("--checkpoint-dir", "s3://parcae-ckpt/job1"),
                           env_extra=s3.env())
        assert result["failures"] == [], result
        assert result["restarts"] >= 1, "the only member was killed: the job must have restarted"
        run_dir = Path(result["run_dir"])
        assert not (run_dir / "ckpt").exists(), "nothing may be written on the instances' own disk"
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        relaunches = [e for e in events if e.get("event") == "launch" and e.get("resume_ckpt")]
        assert relaunches and all(e["resume_ckpt"].startswith("s3://parcae-ckpt/job1/step-") for e in relaunches)
        store = CheckpointStore("s3://parcae-ckpt/job1", storage_options=s3.storage_options())
        refs = store.complete()
        assert refs and len(refs) <= 2 and refs[-1].step > 0  # pruned to the newest two
        assert refs[-1].manifest["writer"].startswith("i")


def test_an_unusable_checkpoint_dir_is_refused_before_any_worker_starts(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("s3fs")
    with S3Server() as s3:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in s3.env().items():
                mp.setenv(k, v)
            rc = main(["--instances", "1", "--run-dir", str(tmp_path / "run"), "--checkpoint-dir",
                       "s3://bucket-that-is-not-there/job", "--", sys.executable, "-c", "raise SystemExit(9)"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "bucket-that-is-not-there" in err and "create it first" in err
    assert not (tmp_path / "run" / "logs").exists()  # no worker was started


def test_a_scheme_without_a_backend_names_the_extra(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import adlfs  # noqa: F401

        pytest.skip("adlfs is installed here")
    except ImportError:
        pass
    rc = main(["--instances", "1", "--run-dir", str(tmp_path), "--checkpoint-dir", "az://container/job", "--",
               sys.executable, "-c", "pass"])
    assert rc == 2 and "lightning-parcae[azure]" in capsys.readouterr().err
