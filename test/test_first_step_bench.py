"""bench.first_step on the nanoGPT-shaped loop: every mode measured in a process of its own.

No timing is asserted (the machine is shared); the compiles of the first two steps are:
the fused step compiles one program where upstream compiles its forward, backward and
optimizer pieces (and the nanoGPT-shaped loop recompiles them as its eager AdamW's state appears).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from limits import HANG_TIMEOUT_S
from torch_xla_bridge.names import BACKEND_NAME, STEP_BACKEND_NAME, UPSTREAM_BACKEND_NAME

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_first_step_report(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "first_step.json"
    proc = subprocess.run([sys.executable, "-m", "bench.first_step", "--scripts", "nanogpt_shaped", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {UPSTREAM_BACKEND_NAME, BACKEND_NAME, STEP_BACKEND_NAME}
    assert rows[UPSTREAM_BACKEND_NAME]["ratio"] == 1.0
    assert all(r["first_two_s"] > 0 for r in rows.values())
    compiles = {m: r["compiles"] for m, r in rows.items()}
    # Two steps of the fused step: its forward + backward + optimizer program, and the fresh-state sync.
    assert compiles[STEP_BACKEND_NAME] == 2, compiles
    assert compiles[STEP_BACKEND_NAME] < compiles[BACKEND_NAME] <= compiles[UPSTREAM_BACKEND_NAME], compiles
