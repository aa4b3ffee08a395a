#!/usr/bin/env bash
# Issue 21's replay at the p3 segments' real counts (up to 32 instances) on the lent 16-core device machine, in
# one command of under 10 minutes (the device's per-command limit; $OUT is emptied between commands and an idle
# machine goes back after 30 s, so everything runs in one go).
#
# The emulated GPT-1.5B cluster (examples/gpt/emulated_gpt15b.yaml, `--emulated-devices --oversubscribe`) at time
# scale 8 (a 60 s interval in 7.5 s), the first 16 intervals of hh_55_65 at its real counts (32 -> 25), P >= 6:
#   1. three static shapes, 15 s each (4x6, 4x7, 4x8: D divides the global batch 128 over M = 16; the best
#      shape per count gives "ideal");
#   2. parcae and live-reactive on the segment, start-up outside it (--trace-clock first-step);
#   3. the simulator's forecast of each run from its own profile (bench_replay does it).
# Why scale 8: a process's real CPU per step is ~0.27 s whatever D (16 micro-batches of tiny layers; measured at
# N = 24 on 2 cores, stop 30), so 32 processes need ~0.54 s of wall per step on 16 cores; the emulation stayed
# faithful on 2 cores (N = 10, scale 10) with the CPU ~60 % busy, which at 4x8 (344.7 modelled samples/s at scale
# 20, a 0.37 s step) means a scale of ~8. The printed "measured / modelled" of the static shapes says whether it
# held (0.83-0.88 at N <= 10 on 2 cores); PARCAE_DEVICE_SCALE changes it.
#
# Prepare here (the device reaches no package index; its image has torch, pytorch-lightning, torchmetrics,
# statsmodels, scipy, matplotlib, but not jsonargparse, which LightningCLI needs):
#   mkdir -p .device_wheels && echo /.device_wheels/ >> "$(git rev-parse --git-path info/exclude)"
#   pip download --no-deps -d .device_wheels jsonargparse==4.53.0 typeshed_client==2.15.0 docstring_parser==0.18.0
# Then one device call: run(command="bash benchmarks/device_replay.sh", carry=[".device_wheels"], timeout_s=600).
# Expected time there: 3 x (start-up ~30 s + 15 s) + 2 x (start-up ~40 s + 16 x 7.5 s) ~ 8 min (not yet seen).
# Results under $OUT (or the first argument): replay/results.json, results.md, replay.png, and the log.
set -u
out=${1:-${OUT:-/tmp/device_replay}}
mkdir -p "$out"
repo=$(pwd)
export PYTHONPATH=$repo PYTHONUNBUFFERED=1
log="$out/device_replay.log"
exec > >(tee "$log") 2>&1
echo "== $(date -u +%FT%TZ) $(nproc) cores; $(python3 -c 'import torch; print("torch", torch.__version__)')"
if ls .device_wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/device_site .device_wheels/*.whl \
    && export PYTHONPATH=$repo:/tmp/device_site
fi
# preflight: every module the job imports, so that a missing package fails in seconds with its name
python3 - <<'EOF' || { echo "preflight failed: carry the missing package's wheel in .device_wheels (see the header)"; exit 2; }
import importlib
for name in ("jsonargparse", "pytorch_lightning.cli", "statsmodels", "lightning_parcae.launch.run",
             "lightning_parcae.training.strategy", "lightning_parcae.testing.emulated_cluster"):
    importlib.import_module(name)
print("preflight: imports ok")
EOF
# knobs (defaults: the device run; a smoke test here: PARCAE_DEVICE_MAX=6 PARCAE_DEVICE_SHAPES=1x6 ...)
scale=${PARCAE_DEVICE_SCALE:-8}
timeout "${PARCAE_DEVICE_TIMEOUT:-560}" python3 benchmarks/bench_replay.py --job gpt15b --time-scale "$scale" \
  --max-instances "${PARCAE_DEVICE_MAX:-32}" --intervals "${PARCAE_DEVICE_INTERVALS:-16}" --pipeline-stages 6 \
  --segments hh_55_65 --policies parcae,reactive --shapes "${PARCAE_DEVICE_SHAPES:-4x6,4x7,4x8}" \
  --static-seconds 15 --trace-clock first-step --out "$out/replay"
echo "rc=$?"
# the emulation's faithfulness at these N: measured static samples/s against the workload's modelled step
python3 - "$out/replay/results.json" "$scale" <<'EOF'
import json, sys
from lightning_parcae.testing.emulated_cluster import EmulatedWorkload
try:
    static = json.load(open(sys.argv[1]))["static"]
except (OSError, KeyError, ValueError) as exc:
    sys.exit(f"no static measurements: {exc}")
w = EmulatedWorkload.gpt_1_5b(time_scale=float(sys.argv[2])).coarsened(24)
for shape, measured in static.items():
    d, p = (int(x) for x in shape.split("x"))
    modelled = 128 / w.step_s(d, p, 16)
    print(f"static {shape} (N={d * p}): measured {measured:.1f} samples/s, modelled {modelled:.1f}, "
          f"measured / modelled {measured / modelled:.2f}")
EOF
rm -rf "$out/replay"/*/  # run folders: too many files to come back; results.json holds what they gave
ls -la "$out" "$out/replay"
