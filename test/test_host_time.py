"""bench.host_time on a tiny workload: its report has every mode, measured, with the executions each mode documents.

No timing is asserted (the machine is shared); only what the bench writes.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from bench.worker import MODES
from limits import HANG_TIMEOUT_S
from torch_xla_bridge.names import BACKEND_NAME, STEP_BACKEND_NAME, UPSTREAM_BACKEND_NAME

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_host_time_report(tmp_path: pathlib.Path) -> None:
    # Its own process, as the bench runs: the trainers compile with a fresh dynamo and metrics.
    env = {k: v for k, v in os.environ.items() if k != "BENCH_JAX_PYTHON"}
    env["PJRT_DEVICE"] = "CPU"
    args = ["--workloads", "bank10", "--warmup", "2", "--rounds", "1", "--steps", "2", "--block", "2"]
    proc = subprocess.run([sys.executable, "-m", "bench.host_time", *args, "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "host_time.json").read_text())
    (w,) = report["workloads"]
    rows = w["rows"]
    assert set(MODES) <= set(rows)
    for mode in MODES:
        r = rows[mode]
        assert r["tensors"] == 10
        assert r["host_ms"] > 0 and r["device_ms"] > 0 and r["pipelined_ms"] > 0, (mode, r)
        assert r["host_ratio"] > 0 and r["pipelined_ratio"] > 0
        # One thread's CPU time within a call cannot exceed the call's wall time (timer granularity aside).
        assert 0 < r["host_cpu_ms"] <= r["host_ms"] + 0.05, (mode, r)
    # The counts the backends document (docs/fused_step.md, docs/benchmarks.md), compiled optimizer.
    execs = {m: rows[m]["executions_per_step"] for m in MODES}
    assert execs[STEP_BACKEND_NAME] == execs["lazy"] == execs["torch_xla.compile"] == 1
    assert execs[BACKEND_NAME] == execs[UPSTREAM_BACKEND_NAME] - 2
    assert rows[UPSTREAM_BACKEND_NAME]["host_ratio"] == 1.0
    md = (tmp_path / "host_time.md").read_text()
    assert "## bank10" in md and all(f"| {m} |" in md for m in MODES)
    # jax is not in the project's environment: the JAX row is absent, and the report says why
    # (unless this interpreter does have jax).
    if "jax.jit" not in rows:
        assert report["jax_note"] == "jax not available"


def test_step_time_alternates_modes_each_in_a_process_of_its_own() -> None:
    # bench.worker's step time (results.md): every block is one reply of that mode's own trainer process.
    cfg = dict(workload="bank10", loop="zero_grads", modes=[UPSTREAM_BACKEND_NAME, STEP_BACKEND_NAME],
               warmup=1, blocks=2, block=2)
    env = dict(os.environ, PJRT_DEVICE="CPU")
    proc = subprocess.run([sys.executable, "-m", "bench.worker", json.dumps(cfg)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    timing = json.loads(proc.stdout.splitlines()[-1])["timing"]
    assert set(timing) == set(cfg["modes"])
    for mode, t in timing.items():
        assert 0 < t["step_p25_ms"] <= t["step_ms"] <= t["step_p75_ms"], (mode, t)
