"""XLA executions per training step with a patched torch_xla, fused and unfused (the PR's numbers).

Runs against whichever ``torch_xla`` is first on the path (put the patched copy
first with PYTHONPATH) and uses only torch and torch_xla. For each loop it
trains a 3-layer MLP with ``backend="openxla"``, once with
``torch_xla._dynamo.config.fused_backward`` on and once off, and prints one
JSON object: executions per steady-state step, ``DynamoSyncInputExecuteTime``
executions after warm-up, and whether any ``.grad`` was pending after backward.

    PJRT_DEVICE=CPU PYTHONPATH=<patched parent> python upstream/measure.py
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
from torch_xla._dynamo import config  # noqa: E402

# The suite's counting helpers and model (they need only torch and torch_xla).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))
from xla_helpers import counter, executions, mlp  # noqa: E402

STEPS, WARMUP = 6, 2
LOOPS = {
    # name: (set_to_none, compiled optimizer)
    "set_to_none=True, compiled optimizer": (True, True),
    "set_to_none=False, compiled optimizer": (False, True),
    "eager optimizer + mark_step": (True, False),
}


def run(set_to_none: bool, compiled_optimizer: bool, fused: bool) -> dict:
    """Trains for STEPS steps; returns steady-state executions per step and the sync-input count."""
    config.fused_backward = fused
    torch._dynamo.reset()
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = mlp(depth=3, width=32).to(dev)  # 16-32-32-4
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fwd = torch.compile(lambda x, y: F.mse_loss(model(x), y), backend="openxla")
    step = torch.compile(opt.step, backend="openxla") if compiled_optimizer else opt.step
    x, y = torch.randn(8, 16).to(dev), torch.randn(8, 4).to(dev)
    torch_xla.sync()
    per_step, pending, sync_inputs, losses = [], [], 0, []
    for i in range(STEPS):
        if i == WARMUP:
            sync_inputs = counter("DynamoSyncInputExecuteTime")
        before = executions()
        opt.zero_grad(set_to_none=set_to_none)
        loss = fwd(x, y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        pending.append(any(torch_xla._XLAC._check_tensor_need_materialization(grads)))
        step()
        if not compiled_optimizer:
            torch_xla.sync()
        losses.append(loss.item())
        per_step.append(executions() - before)
    return {
        "executions_per_step": per_step[WARMUP:],
        "sync_input_executions_after_warmup": counter("DynamoSyncInputExecuteTime") - sync_inputs,
        "grad_pending_after_backward": any(pending[WARMUP:]),
        "losses": losses,
    }


def main() -> None:
    results = {
        name: {"fused": run(*loop, fused=True), "unfused": run(*loop, fused=False)}
        for name, loop in LOOPS.items()
    }
    print(json.dumps({"torch_xla": torch_xla.__file__, "bridge_imported": "torch_xla_bridge" in sys.modules,
                      "results": results}))


if __name__ == "__main__":
    main()
