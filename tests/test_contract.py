"""The worker contract's one builder (``lightning_parcae.contract.worker_contract``).

Problem it guards: the ``PARCAE_*`` environment was assembled in three modules (the elastic fleet, the restart
fallback, the agent) and drifted; now all three call one function, and each variable appears only when given.
"""

from __future__ import annotations

from lightning_parcae import contract as c


def test_every_argument_sets_its_variable_in_the_contracts_format() -> None:
    env = c.worker_contract(store="tcp://h:1", token="t", elastic=True, run_dir="/r", member="i3", join=True,
                            generation=2, pipeline_stages="auto", mode="elastic", interval_s=3.0, stall_s=7.5,
                            shared_cores=4, resume="/r/ckpt/last.ckpt")
    assert env == {
        c.ELASTIC_ENV: "1", c.STORE_ENV: "tcp://h:1", c.JOB_TOKEN_ENV: "t", c.RUN_DIR_ENV: "/r", c.MEMBER_ENV: "i3",
        c.JOIN_ENV: "1", c.GENERATION_ENV: "2", c.GENERATION_BASE_ENV: "2000", c.PIPELINE_ENV: "auto",
        c.MODE_ENV: "elastic", c.INTERVAL_ENV: "3", c.STALL_ENV: "7.5", c.SHARED_CORES_ENV: "4",
        c.RESUME_ENV: "/r/ckpt/last.ckpt",
    }
    assert all(k.startswith(c.ENV_PREFIX) for k in env)


def test_what_is_not_given_is_left_to_the_workers_default() -> None:
    env = c.worker_contract(store="etcd://h:2379/p", token=None, elastic=False, join=False, stall_s=0)
    assert env == {c.ELASTIC_ENV: "0", c.STORE_ENV: "etcd://h:2379/p", c.JOIN_ENV: "0"}
    assert c.JOB_TOKEN_ENV not in c.worker_contract(store="s", token="", elastic=True)
