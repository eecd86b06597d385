"""The project's benchmarks (``python -m bench``; see docs/benchmarks.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

# The repository root: the benchmarks' subprocesses run there, and their results go under it.
ROOT = Path(__file__).resolve().parent.parent


def run_config(cfg: dict, timeout: float) -> dict:
    """One configuration of `bench.worker` in a fresh process: its JSON row, or ``cfg`` with the error it stopped with."""
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    proc = subprocess.run([sys.executable, "-m", "bench.worker", json.dumps(cfg)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(cfg, error=(proc.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(lines[-1])
