"""Start-up hook of ``parcae run`` / ``parcae agent`` workers (this directory is put on their ``PYTHONPATH``).

It imports ``lightning_parcae`` (light: no torch) so that ``Trainer(strategy="parcae")`` resolves in a script that
never imports this package, then hands over to any other ``sitecustomize`` further down ``sys.path``.
"""

import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
try:
    import lightning_parcae  # noqa: F401  (installs the registration hook)
except Exception as exc:  # noqa: BLE001 -- never stop a worker from starting
    print(f"lightning_parcae boot: {exc}", file=sys.stderr)

# chain to the next sitecustomize on the path (e.g. a distribution's), if any
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None and os.path.dirname(os.path.abspath(_spec.origin or "")) != _here:
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
