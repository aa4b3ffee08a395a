#!/usr/bin/env bash
# The README's test command: set up the venv (idempotent) and run the default (fast) test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test,etcd]' 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pytest "$@"
