#!/usr/bin/env bash
# Creates or refreshes the project's virtual environment in .venv (idempotent).
# Sourced by demo.sh and test.sh; installs the package with its pinned
# dependencies (torch==2.9.0, torch_xla==2.9.0) and the test and benchmark
# extras (pytest, torchvision, transformers, tqdm, matplotlib) and mkdocs for the docs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ ! -x "$ROOT/.venv/bin/python" ]; then
  "$PY" -m venv "$ROOT/.venv"
fi
"$ROOT/.venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$ROOT/.venv/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test,bench,docs]"
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
VENV_PY="$ROOT/.venv/bin/python"
