"""The deployment recipes in ``examples/deploy/`` are well-formed and speak the project's real CLI.

Problem it guards (issue 20): recipes that are never applied rot silently -- a renamed flag (the docs said
``--notice-source`` while ``parcae agent`` takes ``--notices``), a Secret mounted under a name nobody creates, a
grace period forgotten. Nothing here reaches a cluster or a cloud: every YAML file must parse, the Kubernetes
objects must have the fields they need and refer to each other consistently, and every ``parcae ...`` command line
in the recipes, their README and ``docs/cloud.md`` must be accepted by the real argument parsers of
:mod:`lightning_parcae.launch`. Where ``kubectl`` is installed, the kustomization is also built offline.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from lightning_parcae.errors import ParcaeError
from lightning_parcae.launch import agent, cli, run, store_init, store_start
from lightning_parcae.launch.rendezvous import parse_nodes
from lightning_parcae.runtime.store import parse_store_url

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "examples" / "deploy"
K8S = DEPLOY / "kubernetes"
SKY = DEPLOY / "skypilot"
MANIFESTS = ("etcd.yaml", "networkpolicy.yaml", "agents.yaml")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for name in MANIFESTS for d in _docs(K8S / name)}


def _flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


# ---------------------------------------------------------------------------------------------------------------
# the command lines
# ---------------------------------------------------------------------------------------------------------------
def check_parcae_command(tokens: list[str]) -> None:
    """Fail unless ``tokens`` (``parcae SUB ...``) is accepted by the real parser of that sub-command."""
    assert tokens[0] == "parcae", tokens
    where = " ".join(tokens)
    try:
        if tokens[1] == "agent":
            ns = agent.build_parser().parse_args(tokens[2:])
            cmd = [c for c in ns.command if c != "--"]
            assert cmd, f"{where}: no training command after --"
            if ns.nodes is not None and ns.nodes != "MIN:MAX":
                parse_nodes(ns.nodes)
            if ns.node_rank is None and ns.nodes is not None and not ns.join:
                assert ":" in ns.nodes or ns.nodes.isdigit(), where
            if not ns.store.startswith("$") and "<" not in ns.store:
                parse_store_url(ns.store)
        elif tokens[1:3] == ["store", "start"]:
            ns = store_start.build_start_parser().parse_args(tokens[3:])
            store_start.StoreService(ns.listen, ns.data_dir, ns.token_file, job=ns.job, advertise=ns.advertise,
                                     peer_port=ns.peer_port)  # validates --listen, --advertise, --job
        elif tokens[1:3] == ["store", "status"]:
            store_start.build_status_parser().parse_args(tokens[3:])
        elif tokens[1:3] == ["store", "init"]:
            store_init.build_parser().parse_args(tokens[3:])
        elif tokens[1] == "run":  # its parser only: _config also probes --checkpoint-dir over the network
            k = tokens.index("--")
            ns = run.build_parser().parse_args(tokens[2:k])
            assert not ns.command and tokens[k + 1:], f"{where}: the worker command goes after --"
        else:
            cli.build_parser().parse_args(tokens[1:])
    except SystemExit as exc:  # argparse's way of saying no
        pytest.fail(f"the real CLI rejects `{where}` (exit {exc.code})")
    except (ParcaeError, ValueError) as exc:
        pytest.fail(f"the real CLI rejects `{where}`: {exc}")


def shell_commands(script: str) -> Iterator[list[str]]:
    """The ``parcae ...`` commands of a shell script or code block (continuations joined, comments dropped, one per
    ``&&``/``;``/``|`` segment; in ``kubectl exec ... -- parcae ...`` the part from ``parcae``)."""
    for line in script.replace("\\\n", " ").splitlines():
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        segments: list[list[str]] = [[]]
        for t in tokens:
            if t in ("&&", "||", ";", "|"):
                segments.append([])
            else:
                segments[-1].append(t)
        for seg in segments:
            if "parcae" in seg and (seg[0] == "parcae" or seg[:2] == ["kubectl", "exec"]):
                yield seg[seg.index("parcae"):]


def markdown_commands(path: Path) -> list[list[str]]:
    """The ``parcae ...`` commands in the fenced code blocks of a Markdown file."""
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", path.read_text(), flags=re.S)
    return [c for b in blocks for c in shell_commands(b)]


def test_the_command_checker_rejects_a_flag_the_cli_does_not_have() -> None:
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        check_parcae_command(["parcae", "agent", "--store", "etcd://h:2379/p/j", "--nodes", "2:4",
                              "--notice-source", "aws", "--", "python", "train.py"])
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        check_parcae_command(["parcae", "store", "start", "--listen", "0.0.0.0:2379"])  # no --advertise
    assert list(shell_commands("x=1 && parcae store status --store etcd://a:1/p # c\n  parcae agent \\\n --join")) \
        == [["parcae", "store", "status", "--store", "etcd://a:1/p"], ["parcae", "agent", "--join"]]


def test_every_yaml_file_of_the_recipes_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert {f.name for f in files} >= {"kustomization.yaml", *MANIFESTS, "store.yaml", "agents.yaml"}
    for f in files:
        assert _docs(f), f"{f} holds no YAML document"


def test_every_parcae_command_in_the_recipes_and_their_docs_is_the_real_cli() -> None:
    found: dict[str, int] = {}
    k8s = [c["args"] for d in _objects().values() if d["kind"] in ("Deployment", "StatefulSet")
           for c in d["spec"]["template"]["spec"]["containers"]]
    found["kubernetes"] = len(k8s)
    for args in k8s:
        check_parcae_command([str(a) for a in args])
    for f in sorted(SKY.glob("*.yaml")):
        task = _docs(f)[0]
        cmds = [c for part in ("setup", "run") for c in shell_commands(task.get(part) or "")]
        found[f.name] = len(cmds)
        for c in cmds:
            check_parcae_command(c)
    for doc in (DEPLOY / "README.md", ROOT / "docs" / "cloud.md"):
        cmds = markdown_commands(doc)
        found[doc.name] = len(cmds)
        for c in cmds:
            check_parcae_command(c)
    assert found["kubernetes"] == 2 and found["store.yaml"] == 1 and found["agents.yaml"] == 1, found
    assert found["README.md"] >= 4 and found["cloud.md"] >= 5, found


# ---------------------------------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------------------------------
def test_every_kubernetes_object_has_kind_api_version_and_name() -> None:
    for name in MANIFESTS:
        for d in _docs(K8S / name):
            assert d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"), (name, d)
    kinds = {kind for kind, _ in _objects()}
    assert kinds == {"Service", "StatefulSet", "NetworkPolicy", "ServiceAccount", "Deployment"}
    kust = _docs(K8S / "kustomization.yaml")[0]
    assert kust["kind"] == "Kustomization" and sorted(kust["resources"]) == sorted(MANIFESTS)
    assert "job1.token" in (K8S / ".gitignore").read_text()  # the token file never goes into git


def test_the_agents_run_on_spot_nodes_with_a_grace_period_and_the_token_secret() -> None:
    objs = _objects()
    dep = objs[("Deployment", "parcae-agents")]
    assert dep["apiVersion"] == "apps/v1"
    tmpl = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()
    pod = tmpl["spec"]
    assert isinstance(pod["terminationGracePeriodSeconds"], int) and 30 <= pod["terminationGracePeriodSeconds"] <= 120
    assert any("spot" in f"{k}={v}".lower() for k, v in pod["nodeSelector"].items())
    assert pod["tolerations"] and all({"key", "operator", "effect"} <= set(t) for t in pod["tolerations"])
    assert pod["serviceAccountName"] in {n for k, n in objs if k == "ServiceAccount"}
    (c,) = pod["containers"]
    args = [str(a) for a in c["args"]]
    assert args[:2] == ["parcae", "agent"] and "--node-rank" not in args  # no ranks: the agents agree on them
    lo, hi = parse_nodes(_flag(args, "--nodes"))
    assert lo < hi and dep["spec"]["replicas"] <= hi
    assert _flag(args, "--notices") == "sigterm"  # Kubernetes' notice is SIGTERM, then the grace period
    assert _flag(args, "--checkpoint-dir").startswith("s3://")
    _secret_mounted(pod, c, _flag(args, "--token-file"))
    store = parse_store_url(_flag(args, "--store"))
    svc = objs[("Service", store.host)]
    assert store.port in [p["port"] for p in svc["spec"]["ports"]]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


def _secret_mounted(pod: dict[str, Any], container: dict[str, Any], token_file: str) -> None:
    """``token_file`` lies in a read-only mount of the Secret the kustomization generates."""
    secret = _docs(K8S / "kustomization.yaml")[0]["secretGenerator"][0]
    key = secret["files"][0].split("=")[0]
    mount = next(m for m in container["volumeMounts"] if token_file == f"{m['mountPath']}/{key}")
    assert mount.get("readOnly") is True
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert vol["secret"]["secretName"] == secret["name"]


def test_the_store_runs_parcae_store_start_on_on_demand_nodes_behind_its_service() -> None:
    objs = _objects()
    sts = objs[("StatefulSet", "parcae-etcd")]
    svc = objs[("Service", sts["spec"]["serviceName"])]
    pod = sts["spec"]["template"]["spec"]
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["replicas"] == 1 and "terminationGracePeriodSeconds" in pod
    assert not any("spot" in f"{k}={v}".lower() for k, v in pod["nodeSelector"].items())
    (c,) = pod["containers"]
    args = [str(a) for a in c["args"]]
    assert args[:3] == ["parcae", "store", "start"]
    host, port = store_start.parse_listen(_flag(args, "--listen"))
    assert port == c["ports"][0]["containerPort"] == svc["spec"]["ports"][0]["port"]
    assert _flag(args, "--advertise") == svc["metadata"]["name"]
    _secret_mounted(pod, c, _flag(args, "--token-file"))
    data = next(m for m in c["volumeMounts"] if m["mountPath"] == _flag(args, "--data-dir"))
    assert data["name"] in [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]]
    # the agents' --store is this store's job prefix
    agent_args = [str(a) for a in objs[("Deployment", "parcae-agents")]["spec"]["template"]["spec"]
                  ["containers"][0]["args"]]
    assert _flag(agent_args, "--store") == f"etcd://{svc['metadata']['name']}:{port}/parcae/{_flag(args, '--job')}"
    pol = objs[("NetworkPolicy", "parcae-etcd-clients")]["spec"]
    assert pol["podSelector"]["matchLabels"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    allowed = pol["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed.items() <= objs[("Deployment", "parcae-agents")]["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (its built-in kustomize builds offline)")
def test_the_kustomization_builds_with_the_secret_and_the_image(tmp_path: Path) -> None:
    work = tmp_path / "kubernetes"
    shutil.copytree(K8S, work)
    (work / "job1.token").write_text("not-a-real-token\n")
    out = subprocess.run(["kubectl", "kustomize", str(work)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    built = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}
    assert "token" in built[("Secret", "parcae-job1-token")]["data"]
    image = built[("Deployment", "parcae-agents")]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "REGISTRY/parcae-train:0.1"


# ---------------------------------------------------------------------------------------------------------------
# SkyPilot
# ---------------------------------------------------------------------------------------------------------------
def test_the_skypilot_tasks_put_agents_on_spot_and_the_store_on_demand() -> None:
    agents, store = _docs(SKY / "agents.yaml")[0], _docs(SKY / "store.yaml")[0]
    assert agents["resources"]["use_spot"] is True and isinstance(agents["num_nodes"], int)
    assert agents["num_nodes"] >= 2 and store["resources"]["use_spot"] is False and "num_nodes" not in store
    (cmd,) = list(shell_commands(agents["run"]))
    lo, hi = parse_nodes(_flag(cmd, "--nodes"))
    assert lo <= agents["num_nodes"] <= hi and "--node-rank" not in cmd
    for task, token_file in ((agents, _flag(cmd, "--token-file")),
                             (store, _flag(list(shell_commands(store["run"]))[0], "--token-file"))):
        assert token_file in task["file_mounts"] and f"chmod 600 {token_file}" in task["setup"]
        assert "pip install" in task["setup"]
    assert "etcd-server" in store["setup"]
