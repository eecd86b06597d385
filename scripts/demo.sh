#!/usr/bin/env bash
# Sets up the environment, then trains a model with `openxla` and
# `openxla_fused_grad` and prints XLA executions per step side by side.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$VENV_PY" examples/demo.py "$@"
