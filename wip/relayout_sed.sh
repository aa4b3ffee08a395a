#!/usr/bin/env bash
# Rewrite old module paths to the issue-10 layout in the given files (idempotent).
set -e
sed -i -E \
  -e 's/lightning_parcae\.availability\.notices\b/lightning_parcae.signals.notices/g' \
  -e 's/lightning_parcae\.availability\b/lightning_parcae.signals/g' \
  -e 's/lightning_parcae\.traces\b/lightning_parcae.signals.traces/g' \
  -e 's/lightning_parcae\.predictor\b/lightning_parcae.planning.forecast/g' \
  -e 's/lightning_parcae\.costmodel\b/lightning_parcae.planning.costmodel/g' \
  -e 's/lightning_parcae\.liveput\b/lightning_parcae.planning.liveput/g' \
  -e 's/lightning_parcae\.optimizer\b/lightning_parcae.planning.shape_optimizer/g' \
  -e 's/lightning_parcae\.planner\b/lightning_parcae.planning.migration_plan/g' \
  -e 's/lightning_parcae\.sim\b/lightning_parcae.planning.sim/g' \
  -e 's/lightning_parcae\.strategy\b/lightning_parcae.training.strategy/g' \
  -e 's/lightning_parcae\.callbacks\b/lightning_parcae.training.callbacks/g' \
  -e 's/lightning_parcae\.run\b/lightning_parcae.launch.run/g' \
  -e 's/lightning_parcae\.agent\b/lightning_parcae.launch.agent/g' \
  -e 's/lightning_parcae\.cli\b/lightning_parcae.launch.cli/g' \
  -e 's/lightning_parcae\.runtime\.etcd_server\b/lightning_parcae.testing.etcd_server/g' \
  -e 's/from lightning_parcae import run as run_mod/from lightning_parcae.launch import run as run_mod/' \
  -e 's/from lightning_parcae import predictor as P/from lightning_parcae.planning import forecast as P/' \
  -e 's#lightning_parcae/availability/notices\.py#lightning_parcae/signals/notices.py#g' \
  -e 's#lightning_parcae/(traces)\.py#lightning_parcae/signals/\1.py#g' \
  -e 's#lightning_parcae/predictor\.py#lightning_parcae/planning/forecast.py#g' \
  -e 's#lightning_parcae/optimizer\.py#lightning_parcae/planning/shape_optimizer.py#g' \
  -e 's#lightning_parcae/planner\.py#lightning_parcae/planning/migration_plan.py#g' \
  -e 's#lightning_parcae/(costmodel|liveput)\.py#lightning_parcae/planning/\1.py#g' \
  -e 's#lightning_parcae/sim/#lightning_parcae/planning/sim/#g' \
  -e 's#lightning_parcae/(strategy|callbacks)\.py#lightning_parcae/training/\1.py#g' \
  -e 's#lightning_parcae/(run|agent|cli)\.py#lightning_parcae/launch/\1.py#g' \
  -e 's#lightning_parcae/runtime/etcd_server\.py#lightning_parcae/testing/etcd_server.py#g' \
  "$@"
