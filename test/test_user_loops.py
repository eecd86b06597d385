"""The loops users write (test/user_loops.py), each run in a subprocess, against eager CPU.

A loop that crashes the process (a deleted buffer's abort, a segfault) fails
its own test only. Parameters after training are compared with the same loop
run eagerly on the CPU; executions per iteration after warm-up are exact.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import user_loops
from xla_helpers import FUSED, FUSED_STEP, UPSTREAM

HERE = Path(__file__).parent


def run_loop(name: str, backend: str, timeout: int = 600) -> dict[str, Any]:
    """Runs ``user_loops.LOOPS[name]`` on XLA in a fresh process; fails the test if it dies."""
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    proc = subprocess.run(
        [sys.executable, str(HERE / "user_loops.py"), name, backend],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE,
    )
    if proc.returncode != 0:
        pytest.fail(f"{name} with {backend} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def eager_cpu(name: str) -> dict[str, Any]:
    return user_loops.LOOPS[name](None, "cpu")


def assert_matches_eager_cpu(name: str, rec: dict[str, Any], rtol: float = 1e-5, atol: float = 1e-6) -> None:
    want = eager_cpu(name)["params"]
    assert rec["params"].keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(
            torch.tensor(rec["params"][key]), torch.tensor(value), rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}"
        )


# Executions per iteration after the first, per backend, with where they come from.
EXPECTED: dict[str, dict[str, int]] = {
    # fused_grad: G's forward, D(real), D(fake.detach()), D's backward, D(fake) after the
    # input sync of D's pending Adam update (2), G's + D's backward, torch_xla.sync() for
    # opt_g's eager update. fused_step: one execution per optimizer step (its cut).
    "gan": {UPSTREAM: 13, FUSED: 8, FUSED_STEP: 2},
    # 4 x (forward + backward), the sync, reading the logged norms; fused_step: the
    # step and the read.
    "accumulation_with_grad_norms": {UPSTREAM: 14, FUSED: 10, FUSED_STEP: 2},
    # forward, backward, input sync of the clipped .grad, optimizer, reading the norm.
    "clip_compiled_optimizer": {UPSTREAM: 6, FUSED: 5, FUSED_STEP: 1},
    # Upstream openxla aborts here (it donates the .grad buffer that the norm still reads).
    "clip_compiled_optimizer_set_to_none": {FUSED: 5, FUSED_STEP: 1},
}


@pytest.mark.parametrize(
    "name,backend", [(name, backend) for name, counts in EXPECTED.items() for backend in counts]
)
def test_user_loop_trains_like_eager_cpu(name, backend):
    rec = run_loop(name, backend)
    assert_matches_eager_cpu(name, rec)
    want = EXPECTED[name][backend]
    assert rec["executions"][1:] == [want] * (len(rec["executions"]) - 1)
    if backend != UPSTREAM:
        assert rec["warnings"] == []
