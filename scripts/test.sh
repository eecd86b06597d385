#!/usr/bin/env bash
# Sets up the environment, then runs the test suite on PJRT CPU (`-m quick`: the quick tier).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# Test files run in parallel, each whole in one worker (its module-scoped runs shared):
# TEST_WORKERS=0 runs them in this process, one after another.
exec "$VENV_PY" -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
