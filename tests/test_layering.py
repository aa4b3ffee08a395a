"""The folder layout is the data flow: no module imports one above it, and no import cycle.

Layers, bottom to top: ``errors``/``events``/``contract`` -> ``signals`` -> ``planning`` -> ``runtime`` -> ``training`` ->
``launch``. ``testing`` may use anything below ``training``. The runtime reaches the strategy above it only through
the :class:`~lightning_parcae.runtime.host.TrainingHost` protocol, which the strategy must satisfy. Every import counts -- module level, inside a
function, or under ``TYPE_CHECKING`` -- because each one is a dependency a reader has to follow.

Regression: the runtime once imported the strategy (``runtime/elastic.py`` -> ``strategy.py``, for a type hint) and
the Lightning callbacks module (for ``append_event``), while the strategy imported the runtime: three layers tied
into one knot that could only be read all at once. And ``planning.costmodel`` loaded measured profiles through
``planning.measured``, which is built on ``costmodel``: a cycle hidden inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_parcae"

LAYERS = {"errors": 0, "events": 0, "contract": 0, "signals": 1, "planning": 2, "runtime": 3, "training": 4, "testing": 4,
          "launch": 5, "lightning": 5}
"""``lightning`` is the public facade for ``lightning.pytorch`` users (``from lightning_parcae.lightning import
ParcaeStrategy``): it only re-exports the training layer."""
PLANNING_SIDE = ("signals", "planning")
TORCH_MODULES = ("torch", "pytorch_lightning", "lightning", "torchmetrics")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "lightning_parcae":
        return None
    return LAYERS.get(parts[1])


def test_every_package_module_belongs_to_a_layer() -> None:
    stray = [m for m in _modules() if m != "lightning_parcae" and _layer(m) is None]
    assert stray == [], f"modules outside the layered folders: {stray}"


def test_no_module_imports_a_layer_above_it() -> None:
    mods = _modules()
    bad = []
    for mod, path in mods.items():
        own = _layer(mod)
        if own is None:
            continue
        for imp in _imports(path):
            other = _layer(imp)
            if other is not None and other > own:
                bad.append(f"{mod} -> {imp}")
    assert bad == [], "imports against the flow:\n" + "\n".join(sorted(bad))


def test_planning_side_never_imports_torch() -> None:
    bad = []
    for mod, path in _modules().items():
        if mod.split(".")[1:2] and mod.split(".")[1] in PLANNING_SIDE:
            bad += [f"{mod} -> {imp}" for imp in _imports(path) if imp.split(".")[0] in TORCH_MODULES]
    assert bad == [], "the planning side must stay torch-free:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules() -> None:
    mods = _modules()
    graph = {m: {i for i in _imports(p) if i in mods and i != m and not m.startswith(i + ".")} for m, p in mods.items()}
    # a package __init__ importing its own children is not a cycle of concern; drop edges parent -> child
    graph = {m: {i for i in deps if not i.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for nxt in sorted(graph[m]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The checker is not vacuous: a planning module importing the strategy is reported."""
    fake = tmp_path / "m.py"
    fake.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from lightning_parcae.training.strategy import ParcaeStrategy\n")
    imps = _imports(fake)
    assert any((_layer(i) or 0) > LAYERS["planning"] for i in imps)


def test_the_strategy_is_a_training_host_of_the_runtime() -> None:
    """Every member of the runtime's protocol exists on ParcaeStrategy (a rename on either side fails here)."""
    from lightning_parcae.runtime.host import TrainingHost
    from lightning_parcae.training.strategy import ParcaeStrategy

    strategy = ParcaeStrategy(pipeline_stages=1)
    assert isinstance(strategy, TrainingHost)
    members = [m for m in dir(TrainingHost) if not m.startswith("_")] + list(TrainingHost.__annotations__)
    missing = [m for m in members if not hasattr(strategy, m)]
    assert missing == []


COVERED_ELSEWHERE = {
    "lightning": "tests/test_adoption.py and tests/test_strategy.py import ParcaeStrategy and the callbacks from "
                 "this lightning.pytorch facade and train with them",
    "planning/forecast": "tests/test_predictor.py (named after its Predictor API; every predictor, bands, errors)",
    "planning/migration_plan": "tests/test_planner.py (the migration planner: slot assignment, bytes moved)",
    "planning/shape_optimizer": "tests/test_optimizer.py (the receding-horizon optimizer)",
    "planning/sim/policies": "tests/test_sim.py (every policy of the simulator, against the artifact's totals)",
    "planning/kinds": "an enum only; tests/test_planner.py checks the kind of each migration plan and "
                      "tests/test_costmodel.py the kind the cost model names",
    "planning/sim/report": "tests/test_sim.py (Comparison, simulate's report and plot)",
    "runtime/host": "a Protocol only; tests/test_training_strategy_host.py checks ParcaeStrategy satisfies it and "
                    "tests/test_layering.py that the runtime reaches the strategy only through it",
    "signals/notices": "tests/test_availability_notices.py (every notice source against local metadata servers)",
    "testing/etcd_server": "tests/test_runtime_store.py and tests/test_agent.py start a real etcd through it",
    "testing/s3_server": "tests/test_runtime_checkpoint_store.py and tests/test_launch_checkpoint_dir.py run "
                         "against the S3 server it starts",
    "training/boot/sitecustomize": "tests/test_adoption.py (a worker script that never imports lightning_parcae "
                                   "resolves strategy=\"parcae\")",
}
"""Modules whose tests live in a file not named after them, with where and why (issue 24: every module is tested)."""


def _own_test_names(rel: Path) -> set[str]:
    parts = rel.with_suffix("").parts
    names = {"test_" + "_".join(parts), "test_" + parts[-1]}
    if len(parts) > 1:
        names.add("test_" + parts[0] + "_" + parts[-1])
    return names


def test_every_module_has_a_test_file_of_its_own_or_is_named_as_covered_elsewhere() -> None:
    tests = {p.stem for p in Path(__file__).resolve().parent.glob("test_*.py")}
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py":
            continue
        key = str(rel.with_suffix(""))
        if not (_own_test_names(rel) & tests) and key not in COVERED_ELSEWHERE:
            missing.append(key)
    stale = [k for k in COVERED_ELSEWHERE if not (PACKAGE / f"{k}.py").exists()]
    assert missing == [], "modules with no test file of their own (add tests/test_<folder>_<module>.py, or name " \
                          "where they are tested in COVERED_ELSEWHERE):\n" + "\n".join(missing)
    assert stale == [], f"COVERED_ELSEWHERE names modules that no longer exist: {stale}"
    for key, why in COVERED_ELSEWHERE.items():
        named = [w for w in why.split() if w.startswith("tests/test_")]
        assert named and all(Path(__file__).resolve().parent.parent.joinpath(w.rstrip(",;:)")).exists()
                             for w in named), f"{key}: {why!r} must name existing test files"
