"""Every piece of state has one owner, every collaborator a typed interface (issue 24), checked on the source.

Regression: the parts split out of the three big classes (``Launcher``, ``ElasticRuntime``, ``ParcaeStrategy``)
still shared one blackboard. ``launch/fleet.py``, ``relaunch.py`` and ``console.py`` made 104 reads of the
launcher's private fields, the strategy's parts 52 of the strategy's, the runtime's parts 27 of the runtime's -- 227
reads of another object's private attributes in all; 14 parts held their owner as ``rt: Any`` / ``strategy: Any``
and called each other through it; the runtime read its options from ``os.environ`` beside the ones the strategy
passed, so ``max_instances`` never arrived. These checks keep that from growing back:

- reads of another object's private attributes are allowed only in the adapter modules that wrap torch's and
  Lightning's own internals (one each), and stay few;
- no module imports another module's private name;
- no constructor takes its owner as an untyped ``Any``;
- nothing under ``runtime/`` or ``planning/`` reads the environment (configuration arrives as one typed object);
- every module has a test file of its own, or :data:`tests.test_layering.COVERED_ELSEWHERE` names where it is tested
  and why.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_parcae"
TESTS = Path(__file__).resolve().parent

ADAPTERS = {
    "training/lightning_internals.py": "Lightning's private trainer/loop/connector/launcher attributes",
    "runtime/torch_internals.py": "torch.distributed's c10d registry and nn.Module's child table",
}
"""The only modules that may read another object's private attributes, and whose internals each one wraps."""

MAX_PRIVATE_READS = 40
OWNER_NAMES = {"rt", "runtime", "strategy", "owner", "launcher", "parent", "host"}


def _private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            out.append((node.lineno, ast.unparse(node)))
    return out


def _sources() -> dict[str, ast.AST]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def test_private_reads_of_other_objects_stay_in_the_adapters() -> None:
    outside, total = [], 0
    for rel, tree in _sources().items():
        reads = _private_reads(tree)
        total += len(reads)
        if rel not in ADAPTERS:
            outside += [f"{rel}:{line}: {text}" for line, text in reads]
    assert outside == [], "private attributes of another object read outside the adapter modules " \
                          f"{sorted(ADAPTERS)}:\n" + "\n".join(outside)
    assert total <= MAX_PRIVATE_READS, f"{total} private reads in the adapters, more than {MAX_PRIVATE_READS}"


def test_the_private_read_check_sees_one() -> None:
    """The checker is not vacuous: ``x._y`` is a read of another object's private field, ``self._y`` is not."""
    assert _private_reads(ast.parse("def f(self, x):\n    return self._a, x._b\n")) == [(2, "x._b")]


def _any_owner_params(tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for arg in node.args.args[1:] + node.args.kwonlyargs:
                ann = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg in OWNER_NAMES and ann in ("Any", "typing.Any", "'Any'", "\"Any\""):
                    bad.append(f"{node.lineno}: {arg.arg}: {ann}")
    return bad


def test_no_constructor_takes_its_owner_as_any() -> None:
    bad = [f"{rel}:{b}" for rel, tree in _sources().items() for b in _any_owner_params(tree)]
    assert bad == [], "constructors holding their owner untyped (give them a typed collaborator):\n" + "\n".join(bad)


def test_the_owner_check_sees_one() -> None:
    assert _any_owner_params(ast.parse("class A:\n    def __init__(self, rt: Any) -> None: ...\n")) == ["2: rt: Any"]


def _environment_reads(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "getenv") for a in node.names):
                lines.append(node.lineno)
    return lines


def test_runtime_and_planning_never_read_the_environment() -> None:
    bad = [f"{rel}:{line}" for rel, tree in _sources().items() if rel.split("/")[0] in ("runtime", "planning")
           for line in _environment_reads(tree)]
    assert bad == [], "os.environ read below training/ (pass it in the typed configuration instead):\n" + \
                      "\n".join(bad)


def test_the_environment_check_sees_one() -> None:
    assert sorted(_environment_reads(ast.parse("import os\nx = os.environ.get('A')\nfrom os import getenv\n"))) == [2, 3]


def _private_imports(tree: ast.AST) -> list[str]:
    return [f"{n.lineno}: from {n.module} import {a.name}" for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("lightning_parcae")
            for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_no_module_imports_another_modules_private_name() -> None:
    """Regression: the coordinator and the agents' rendezvous signed records with the store's ``_encode_record``,
    the checkpoints copied tensors with ``runtime.checkpoint._to_cpu`` -- private reads the attribute check misses."""
    bad = [f"{rel}:{b}" for rel, tree in _sources().items() for b in _private_imports(tree)]
    assert bad == [], "private names imported from another module (make them public there):\n" + "\n".join(bad)


def test_the_private_import_check_sees_one() -> None:
    assert _private_imports(ast.parse("from lightning_parcae.runtime.store import _x, y\n")) == [
        "1: from lightning_parcae.runtime.store import _x"]
