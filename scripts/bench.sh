#!/usr/bin/env bash
# Sets up the environment, then runs the benchmark suite (`--quick`: under 5 minutes).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$VENV_PY" -m bench "$@"
