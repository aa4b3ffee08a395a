#!/usr/bin/env bash
# The README's test command: set up the venv (idempotent) and run the default (fast) test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 -e '.[test,etcd]' 2>&1 | grep -v '^WARNING: Location' || true
# LitData (the `streaming` extra) for the streaming-data tests, without its torchvision requirement: the registry's
# torchvision wheels do not load against the CPU torch 2.13 wheel ("operator torchvision::nms does not exist") and
# then break `import transformers`; LitData itself imports and streams without it.
.venv/bin/pip install -q --disable-pip-version-check --no-deps 'litdata>=0.2.50' 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/pip install -q --disable-pip-version-check boto3 obstore tifffile requests filelock 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pytest "$@"
