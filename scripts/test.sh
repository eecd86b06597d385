#!/usr/bin/env bash
# Sets up the environment, then runs the test suite on PJRT CPU.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$VENV_PY" -m pytest "$@"
