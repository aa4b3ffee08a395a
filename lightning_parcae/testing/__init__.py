"""Test-only helpers that ship with the package (so that users can test their own jobs the way we test ours).

Problem: multi-machine coordination is tested against a real etcd on loopback; starting and stopping one reliably
(free ports, data directory, readiness, cleanup) is shared by the tests of the store, the agent and the runtime.
"""
