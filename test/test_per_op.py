"""bench.per_op on a tiny run: both processes (functionalization on and off) report every op, and the floor is their sum.

No timing is asserted (the machine is shared); only what the bench writes.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from bench.per_op import FLOOR, MODES
from limits import HANG_TIMEOUT_S

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_per_op_report(tmp_path: pathlib.Path) -> None:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("XLA_DISABLE_FUNCTIONALIZATION", None)
    args = ["--tensors", "50", "--reps", "2", "--workload", "bank10", "--rounds", "2", "--sizes", "20,50",
            "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-m", "bench.per_op", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "per_op.json").read_text())
    assert [r["functionalization"] for r in report["runs"]] == [True, False]
    for run in report["runs"]:
        assert set(run["op_us"]) == set(FLOOR)
        assert all(us > 0 for us in run["op_us"].values()), run
        assert run["floor_us"] == pytest.approx(sum(FLOOR[op] * us for op, us in run["op_us"].items()))
        assert set(run["step_us"]) == set(MODES) and all(us > 0 for us in run["step_us"].values())
        assert run["floor_ratio"] == pytest.approx(run["floor_us"] / run["step_us"]["openxla"])
        assert list(run["embedded_us"]) == ["20", "50"]
        assert all(v["embed"] > 0 and v["sync"] > 0 for v in run["embedded_us"].values()), run["embedded_us"]
    md = (tmp_path / "per_op.md").read_text()
    assert all(f"| {op} |" in md for op in FLOOR) and "floor / `openxla` step" in md
    assert "| 20 |" in md and "| 50 |" in md
