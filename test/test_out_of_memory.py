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
import re
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).resolve().parent / "oom_cases.py"
# Eager CPU beside XLA over 6 steps: float rounding only (measured 3e-7 on losses, 6e-8 on parameters).
LOSS_RTOL, PARAM_ATOL = 1e-6, 1e-6
ACCOUNTING = re.compile(r"XLA's accounting of the step's program: ([\d.]+) GiB \(arguments ([\d.]+), outputs ([\d.]+) "
                        r"of which ([\d.]+) donated, temporaries ([\d.]+)\)")


def run_case(case: str, tmp_path: Path) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("PT_XLA_DEBUG_LEVEL", None), env.pop("PT_XLA_DEBUG_FILE", None)
    if case == "spmd":
        env["CPU_NUM_DEVICES"] = "4"
    if case == "eager":  # with torch_xla's post-compilation analysis: the error gives XLA's accounting of the program
        env.update(PT_XLA_DEBUG_LEVEL="1", PT_XLA_DEBUG_FILE=str(tmp_path / "analysis.txt"))
    proc = subprocess.run([sys.executable, str(CASES), case], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", ["eager", "compiled_optimizer", "accumulation", "zero_grad_kept", "refused_at_compile",
                                  "fused_grad", "spmd"])
def test_refused_step_changes_nothing_and_training_goes_on(case: str, tmp_path: Path) -> None:
    r = run_case(case, tmp_path)
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
    analysis = ACCOUNTING.search(message)
    if case == "eager":
        # The program XLA compiled and then could not allocate: its temporaries are the allocation refused.
        assert analysis, message
        total, arguments, outputs, donated, temporaries = map(float, analysis.groups())
        tried = int(re.search(r"allocating (\d+) bytes", xla_said)[1]) / 2**30
        assert abs(temporaries - tried) <= 0.1 and total >= temporaries and donated <= outputs, message
    else:
        assert analysis is None, message
    if case in ("refused_at_compile", "spmd"):
        assert "PT_XLA_DEBUG_LEVEL" not in message, message  # XLA's own message says what the program needs
    elif case != "eager":
        assert "set PT_XLA_DEBUG_LEVEL=1 and PT_XLA_DEBUG_FILE" in message, message
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


TRAINER_CASE = Path(__file__).resolve().parent / "trainer_oom_case.py"


def test_trainer_auto_find_batch_size_finds_a_batch_that_fits_and_trains_as_eager_cpu(tmp_path: Path) -> None:
    # test/trainer_oom_case.py: GPT-2 under Trainer(auto_find_batch_size=True), the address space limited so that
    # the starting batch (400) is refused at once; accelerate retries at 0.9x until a step fits.
    pytest.importorskip("transformers")
    env = dict(os.environ, PJRT_DEVICE="CPU")
    xla_out, cpu_out = tmp_path / "xla.pt", tmp_path / "cpu.pt"
    proc = subprocess.run([sys.executable, str(TRAINER_CASE), "xla", str(xla_out)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(lines[-1][len("RESULT "):])
    # Every refusal was ours, recognised by accelerate as out of memory, and nothing else was raised.
    assert r["seen"] and all(s["reduce"] and s["type"] == "RuntimeError" for s in r["seen"]), r["seen"]
    assert all(s["message"].startswith("openxla_fused_step: the training step ran out of memory.") for s in r["seen"])
    assert r["batch"] < 400 and r["steps"] == 3, r
    # At the batch found: steady executions, nothing compiled at the third step.
    assert r["executions"][0] == r["executions"][1] and r["compiles"][-1] == 0, r
    # The same Trainer on the CPU at that batch from the start: the refused steps left nothing behind.
    proc = subprocess.run([sys.executable, str(TRAINER_CASE), "cpu", str(cpu_out), str(r["batch"])], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    import torch

    xla, cpu = torch.load(xla_out), torch.load(cpu_out)
    assert xla.keys() == cpu.keys()
    assert max((xla[k] - cpu[k]).abs().max().item() for k in xla) <= PARAM_ATOL
