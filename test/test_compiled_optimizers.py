"""Compiled optimizers (test/optimizer_loops.py) with each backend: executions per step, compilations, eager CPU numerics.

torch's optimizers keep their step counts on the CPU (``capturable=False``),
and a scheduler's tensor ``lr`` is a CPU tensor: both backends read them as
device data of the step's own execution (torch_xla_bridge/host_scalars.py),
so a compiled AdamW costs what a compiled SGD does, and a new lr compiles
nothing. One process per backend trains every configuration.
"""

from __future__ import annotations

import functools
import warnings
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch._dynamo

from limits import HANG_TIMEOUT_S
import optimizer_loops
from test_user_loops import assert_matches_eager_cpu_record
from xla_helpers import FUSED, FUSED_STEP

HERE = Path(__file__).parent
WARMUP = 2  # iteration 1 compiles; iteration 2 first sees the optimizer's state
# Executions per step after warm-up: fused_step runs the whole step as one; fused_grad
# runs forward, backward with accumulation, the optimizer step, and loss.item() reads the
# loss's eager ops (pow, mean), as with SGD.
EXECUTIONS = {FUSED_STEP: 1, FUSED: 4}


@functools.cache
def run_backend(backend: str) -> dict[str, Any]:
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    proc = subprocess.run(
        [sys.executable, str(HERE / "optimizer_loops.py"), backend],
        capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=env, cwd=HERE,
    )
    if proc.returncode != 0:
        pytest.fail(f"optimizer_loops.py {backend} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Eager CPU cannot run a capturable optimizer; the same algorithm uncaptured is its reference.
EAGER_EQUIVALENT = {"AdamW(capturable=True)": "AdamW"}


@functools.cache
def cpu_run(name: str, backend: Optional[str]) -> dict[str, Any]:
    torch._dynamo.reset()
    return optimizer_loops.train(name, backend, "cpu")


@pytest.mark.parametrize("backend", [FUSED_STEP, FUSED])
@pytest.mark.parametrize("name", list(optimizer_loops.OPTIMIZERS))
def test_compiled_optimizer(name: str, backend: str) -> None:
    rec = run_backend(backend)[name]
    # The step as dynamo traces it, run by torch on the CPU: the same arithmetic, to float precision.
    assert_matches_eager_cpu_record(rec, cpu_run(name, "eager"))
    # Eager CPU: torch's traced optimizer steps order their arithmetic differently from its
    # eager ones (Adam with amsgrad: 1.25e-6 apart on the CPU alone), hence atol 1e-5.
    assert_matches_eager_cpu_record(rec, cpu_run(EAGER_EQUIVALENT.get(name, name), None), rtol=1e-5, atol=1e-5)
    steps = len(rec["executions"])
    assert rec["executions"][WARMUP:] == [EXECUTIONS[backend]] * (steps - WARMUP)
    # A new lr (the scheduler's) is new data, not a new program.
    assert rec["compiles"][WARMUP:] == [0] * (steps - WARMUP)
    assert rec["warnings"] == []
    assert rec["cpu_warnings"] == []


def test_a_float_lr_that_changes_is_named_with_its_fix() -> None:
    """torch_xla makes dynamo compile opt.step anew for each float lr: the warning names the cause and the fix."""
    import torch_xla

    p = torch.nn.Parameter(torch.ones(4, device=torch_xla.device()))
    opt = torch.optim.AdamW([p], lr=1e-2)
    opt_step = torch.compile(opt.step, backend=FUSED_STEP)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            p.grad = torch.full_like(p, 0.5)
            opt.param_groups[0]["lr"] = 1e-2 / (i + 1)
            opt_step()
    ours = [str(w.message) for w in caught if FUSED_STEP in str(w.message)]
    assert len(ours) == 1, ours
    assert "its float 'lr' changed" in ours[0]
    assert "lr=torch.tensor(" in ours[0]
