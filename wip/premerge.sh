#!/usr/bin/env bash
# Usage: premerge.sh BRANCH  (run inside /tmp/mergetest worktree) -> prints a commit id with the branch's own
# changed files rewritten to the new import layout.
set -e
b=$1
base=$(git merge-base main "$b")
git checkout -q --detach "$b"
files=$(git diff --name-only --diff-filter=AM "$base" "$b" | grep -E '\.(py|md|cfg|toml|yaml|yml|sh)$' || true)
if [ -n "$files" ]; then /work/relayout_sed.sh $files; git commit -qam "pre-merge: rewrite this branch's import paths to the signals/planning/runtime/training/launch layout" || true; fi
git rev-parse HEAD
