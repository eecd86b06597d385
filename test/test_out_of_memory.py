"""A step too big for the device is refused with a clear error, and training goes on (test/oom_cases.py).

Each case runs in its own process (a program that needs twice the machine's memory fails at its
first allocation, at once, without swapping): 3 steps at batch 8, the refused step, 3 more at batch 8,
under ``openxla_fused_step`` (and, in one case each, ``openxla_fused_grad`` and SPMD on 4 devices), with
an eager CPU run beside it that skips the refused step. Asserted:

- the refused step raises one ``RuntimeError`` that says the step ran out of memory, keeps XLA's own
  message, and that accelerate's ``find_executable_batch_size`` recognises as out of memory;
- parameters, ``.grad``, optimizer state, BatchNorm statistics and the RNG seed are bitwise what they
  were before the step, and reading them executes nothing (``openxla_fused_grad``: its forward executes
  on its own, as upstream's, so the seed it drew and the statistics it wrote are not put back; its case
  has no BatchNorm);
- the losses the refused step returned do not run it again: they hold XLA's error (refused as its
  execution was prepared, PJRT CPU) or NaN (refused as it compiled, as XLA:TPU refuses it);
- the steps after it run the executions of the steps before it (one for the fused step), compile
  nothing new, and train as eager CPU does with the refused step skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).resolve().parent / "oom_cases.py"
# Eager CPU beside XLA over 6 steps: float rounding only (measured 3e-7 on losses, 6e-8 on parameters).
LOSS_RTOL, PARAM_ATOL = 1e-6, 1e-6


def run_case(case: str) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    if case == "spmd":
        env["CPU_NUM_DEVICES"] = "4"
    proc = subprocess.run([sys.executable, str(CASES), case], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", ["eager", "compiled_optimizer", "accumulation", "zero_grad_kept", "refused_at_compile",
                                  "fused_grad", "spmd"])
def test_refused_step_changes_nothing_and_training_goes_on(case: str) -> None:
    r = run_case(case)
    assert r["error_type"] == "RuntimeError", r
    message = r["error"]
    assert message.startswith(f"{r['backend']}: the training step ran out of memory."), message
    assert "smaller batch" in message and "XLA said: " in message
    xla_said = message.split("XLA said: ", 1)[1]
    if case in ("refused_at_compile", "spmd"):
        assert xla_said.startswith("RESOURCE_EXHAUSTED"), message
        assert r["refused_losses"] == ["nan"], r
    elif case == "fused_grad":
        # Its forward (upstream's) fit and ran; the backward's sync was refused.
        assert "Out of memory allocating" in xla_said, message
        assert [float(v) for v in r["refused_losses"]], r
    else:
        assert "Out of memory allocating" in xla_said and "XLA tried to allocate" in message, message
        assert all(s.startswith("Error preparing computation: Out of memory") for s in r["refused_losses"]), r
    assert r["accelerate_reduces_batch"] in (True, None), r  # None: accelerate not installed
    assert r["rng_kept"] == (case != "fused_grad"), r
    if case == "zero_grad_kept":
        # zero_grad(set_to_none=False) began the step: its zeros are what the .grad held when the step began.
        assert all(name.endswith(".grad") for name in r["changed"]) and r["changed"], r
        assert r["grads_after"] and all(r["grads_after"].values()), r
    else:
        assert r["changed"] == [] and r["grads_after"] == {}, r
        assert r["read_executions"] == 0, r
    steady = r["steady_before"][0]
    assert r["steady_before"] == [steady] * 2 and r["per_step"] == [steady] * 3 and r["compiled_after"] == 0, r
    assert steady == (1 if r["backend"] == "openxla_fused_step" else 3), r
    assert r["loss_diff"] <= LOSS_RTOL and r["param_diff"] <= PARAM_ATOL, r
