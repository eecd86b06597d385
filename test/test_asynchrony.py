"""The step's execution runs while Python goes on: no call of the loop waits for it.

A device-bound step (a few hundred ms of device time on PJRT CPU, a few ms of
host time; ``bench.phases.CHECK_WORKLOAD``), each steady step started from an
idle device: the executions that *complete* during each phase (zero_grad,
forward, backward, ``opt.step()``, the user's ``xm.mark_step()`` after it)
must be none, all of them completing in the final ``xm.wait_device_ops()``,
with exactly the backend's executions per step. An execution completing
earlier means that call waited for it (the step's cut, a release of a donated
buffer, or torch_xla's device barrier in the user's sync).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm

from bench import ROOT
from bench.phases import CHECK_WORKLOAD, CHECKS, PHASES, SPMD_CHECKS, measure, overlap_failures
from torch_xla_bridge import in_flight


@pytest.mark.parametrize("mode,loop,micro", CHECKS, ids=[f"{m}-{lp}-x{k}" for m, lp, k in CHECKS])
def test_step_runs_while_python_goes_on(mode: str, loop: str, micro: int) -> None:
    r = measure(mode, loop, CHECK_WORKLOAD, warmup=2, steps=3, micro=micro)
    assert overlap_failures(r) == [], {p: r["per_step"][p] for p in PHASES}


def test_spmd_step_runs_while_python_goes_on() -> None:
    """The same on a virtual mesh of 4 devices, parameters and batch sharded (its own process)."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    proc = subprocess.run([sys.executable, "-m", "bench.phases", "--check", "--spmd"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| openxla")]
    assert len(rows) == len(SPMD_CHECKS), proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, "\n".join(line for line in proc.stderr.splitlines() if "FAILED" in line)


def test_held_buffers_are_released_two_barriers_later() -> None:
    """What ``in_flight`` holds is the next execution's donated inputs, never pending work, and it is
    gone two step barriers after it was taken: nothing accumulates over steps."""
    dev = torch_xla.device()
    p = torch.nn.Parameter(torch.ones(4, device=dev))
    torch_xla.sync()
    pending = p * 2
    in_flight.keep([pending])  # pending IR: holding it would make it one more output of the step
    assert not any(t is pending for t in in_flight._captured)
    for _ in range(3):
        in_flight.keep([p])
        with torch.no_grad():
            p.add_(1.0)
        torch_xla.sync()
    xm.wait_device_ops()
    assert len(in_flight._captured) == 0
    assert len(in_flight._running) == 1  # the last step's old buffer; the two before it are released
    torch.testing.assert_close(p.cpu(), torch.full((4,), 4.0))


def test_benchmark_fails_on_executions_per_step_other_than_guaranteed() -> None:
    """`python -m bench` (CI's quick run too) fails where a fused backend's executions per step regress:
    the committed full run passes; one more execution in any fused configuration is caught."""
    import json

    from bench.__main__ import execution_regressions

    results = json.loads((ROOT / "docs" / "benchmarks" / "results.json").read_text())["results"]
    assert execution_regressions(results) == []
    fused = [r for r in results if r["mode"] in ("openxla_fused_grad", "openxla_fused_step") and "error" not in r]
    assert fused
    for r in fused:
        assert len(execution_regressions([dict(r, executions_per_step=r["executions_per_step"] + 1)])) == 1
