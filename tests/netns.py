"""Network namespaces as "machines": each member in its own namespace, all bridged, the store in another.

Problem: on loopback a dead peer answers at once with a reset; a vanished cloud VM answers with *silence* (its
packets are dropped), which is where real hangs live. ``tc netem`` and iptables are not available on the CI
machines, but namespaces and veth pairs are (as root): a member whose veth is set down is silent -- its process
lives on, its TCP connections stay open, nothing answers.

Layout (``10.203.<net>.0/24``, addresses only inside the namespaces made here): a hub namespace holds a bridge;
each machine ``k`` is a namespace with one veth end ``p9eth`` (``10.203.<net>.<10 + k>``), the other end on the
bridge; the store's namespace is one more machine (``.2``): it hosts a TCPStore (:meth:`Cluster.host_store`) or the
job's etcd the way a user starts it, ``parcae store start`` (:meth:`Cluster.host_etcd`); :meth:`Cluster.host_s3` puts
an S3 API server (moto) with a bucket on a machine of its own. Workers find their interface with
``GLOO_SOCKET_IFNAME=p9eth``, so every process-group connection goes over the bridge.
"""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from lightning_parcae.testing.s3_server import S3Server

ROOT = str(Path(__file__).resolve().parents[1])
IFNAME = "p9eth"


def unavailable() -> Optional[str]:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (the `ip` command) to create network namespaces"
    probe = f"p9probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Cluster:
    """A bridge plus one namespace per machine (``machines`` names) and one for the store."""

    def __init__(self, machines: list[str], net: Optional[int] = None) -> None:
        self.tag = f"{os.getpid() % 10000}"
        self.net = net if net is not None else 100 + os.getpid() % 150
        self.hub = f"p9hub{self.tag}"
        self.machines = list(machines)
        self.ns: dict[str, str] = {}
        self.addr: dict[str, str] = {}
        self.host_if: dict[str, str] = {}

    def __enter__(self) -> "Cluster":
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for k, name in enumerate(["store", *self.machines]):
                ns = f"p9{k}n{self.tag}"
                _ip("netns", "add", ns)
                hub_if = f"h{k}"
                _ip("link", "add", f"t{k}x{self.tag}", "type", "veth", "peer", "name", f"t{k}y{self.tag}")
                _ip("link", "set", f"t{k}x{self.tag}", "netns", ns)
                _ip("link", "set", f"t{k}y{self.tag}", "netns", self.hub)
                _ip("-n", ns, "link", "set", f"t{k}x{self.tag}", "name", IFNAME)
                _ip("-n", self.hub, "link", "set", f"t{k}y{self.tag}", "name", hub_if)
                addr = f"10.203.{self.net}.{2 if k == 0 else 10 + k}"
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", IFNAME, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.hub, "link", "set", hub_if, "master", "br0")
                _ip("-n", self.hub, "link", "set", hub_if, "up")
                self.ns[name], self.addr[name], self.host_if[name] = ns, addr, hub_if
        except Exception:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in [*self.ns.values(), self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def silence(self, name: str) -> None:
        """Drop every packet to and from ``name`` (its bridge port goes down): no reset, just silence."""
        _ip("-n", self.hub, "link", "set", self.host_if[name], "down")

    def popen(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Run ``cmd`` inside machine ``name``'s namespace (gloo bound to its bridge interface)."""
        env = {**env, "GLOO_SOCKET_IFNAME": IFNAME}
        with open(log, "wb") as f:
            return subprocess.Popen(["ip", "netns", "exec", self.ns[name], *cmd], env=env, stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def host_store(self, token: str, port: int = 29411, log: Optional[Path] = None) -> tuple[str, subprocess.Popen]:
        """A TCPStore hosted inside the store's namespace; returns its URL and the hosting process."""
        url = f"tcp://{self.addr['store']}:{port}"
        code = ("import sys, time\nfrom lightning_parcae.runtime.store import host_store\n"
                "s = host_store(sys.argv[1], token=sys.argv[2], allow_remote=True)\nprint('ready', flush=True)\n"
                "time.sleep(1e6)\n")
        env = {**os.environ, "PYTHONPATH": ROOT}
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns["store"], sys.executable, "-c", code, url, token],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        seen = []
        while True:  # torch may warn first (no resolvable hostname inside a fresh namespace)
            line = proc.stdout.readline().decode()
            seen.append(line)
            if "ready" in line:
                return url, proc
            if not line or len(seen) > 50:
                proc.kill()
                raise RuntimeError("the store did not start in its namespace: " + "".join(seen))

    def host_s3(self, name: str, bucket: str, port: int = 29412) -> "S3Server":
        """An S3 API server (moto) on machine ``name`` with ``bucket`` created through the S3 API from inside that
        namespace; stop it with ``stop()``. Clients need ``server.env()`` in their environment.

        Raises:
            RuntimeError: The bucket could not be created within about 20 s.
        """
        from lightning_parcae.testing.s3_server import S3Server  # noqa: PLC0415

        server = S3Server(host=self.addr[name], port=port, netns=self.ns[name]).start()
        make_bucket = ("import sys, time, boto3\nfor _ in range(100):\n    try:\n"
                       "        boto3.client('s3', endpoint_url=sys.argv[1]).create_bucket(Bucket=sys.argv[2]); break\n"
                       "    except Exception:\n        time.sleep(0.2)\nelse:\n    sys.exit(1)\n")
        r = subprocess.run(["ip", "netns", "exec", self.ns[name], sys.executable, "-c", make_bucket,
                            server.endpoint_url, bucket], env={**os.environ, **server.env()}, timeout=60,
                           capture_output=True, text=True)
        if r.returncode:
            server.stop()
            raise RuntimeError(f"could not create the bucket {bucket!r} on {server.endpoint_url}: {r.stderr[-2000:]}")
        return server

    def host_etcd(self, data_dir: Path, token_file: Path, port: int = 2379, job: str = "job1",
                  timeout_s: float = 60.0) -> tuple[str, subprocess.Popen[bytes]]:
        """The job's etcd as a user starts it, ``parcae store start --listen <store address>:port``, run inside
        the store's namespace; returns its ``--store`` URL (as the command printed it) and the process.

        The command creates ``token_file`` (mode 0600) unless it exists and installs the token's proof; its
        output goes to ``data_dir/store_start.txt``. Stop it with ``terminate()`` (SIGTERM stops etcd).

        Raises:
            RuntimeError: The command exited or did not say it runs within ``timeout_s`` (with its output).
        """
        data_dir.mkdir(parents=True, exist_ok=True)
        log = data_dir / "store_start.txt"
        cmd = [sys.executable, "-m", "lightning_parcae.launch.cli", "store", "start", "--listen",
               f"{self.addr['store']}:{port}", "--data-dir", str(data_dir / "etcd"), "--token-file", str(token_file),
               "--job", job]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PARCAE_")}
        env["PYTHONPATH"] = ROOT
        with open(log, "wb") as f:
            proc = subprocess.Popen(["ip", "netns", "exec", self.ns["store"], *cmd], env=env, stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            if "running in the foreground" in text:
                urls = [line.split("the job's store: ", 1)[1].strip() for line in text.splitlines()
                        if "the job's store: " in line]
                if urls:
                    return urls[0], proc
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        proc.kill()
        proc.wait()
        raise RuntimeError(f"`parcae store start` did not come up in the store's namespace (exit {proc.returncode}):\n"
                           + log.read_text(errors="replace"))


def kill_agents(agents: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGKILL every agent and its workers (found by parent ids: a silenced machine's stay alive), then reap."""
    for p in agents.values():
        for pid in [*descendants(p.pid), p.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (an agent's worker), children first found by their parent ids."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p in frontier]
        out.extend(kids)
        frontier = kids
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file a running job appends to (none if it is not there yet; a line being
    written right now is skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def agent_command(store_url: str, token_file: Path, member: str, run_dir: Path, nodes: str,
                  job: list[str]) -> list[str]:
    """``parcae agent`` for machine ``member`` of a job whose checkpoints go to ``s3://ckpt/job`` (preemption
    notices as SIGTERM to the agent, a 4 s start-up settle), running ``job`` as its worker."""
    return [sys.executable, "-m", "lightning_parcae.launch.cli", "agent", "--store", store_url, "--token-file",
            str(token_file), "--member", member, "--notices", "sigterm", "--run-dir", str(run_dir), "--nodes", nodes,
            "--settle", "4", "--checkpoint-dir", "s3://ckpt/job", "--", *job]
