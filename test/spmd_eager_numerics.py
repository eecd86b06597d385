"""Dropout + BatchNorm training under SPMD (4-device PJRT CPU mesh, batch sharded), for test_eager_numerics.py.

SPMD must be on before the first device use, so this runs as its own process:

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python test/spmd_eager_numerics.py OUT.json

Per backend it writes the executions per step, the largest difference of the
model's state from eager CPU (which replays the compiled run's dropout masks),
whether every step drew a new mask, the fallback warnings, and dropout's
scale check on a sharded input.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before anything touches a device

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

import torch_xla_bridge  # noqa: E402,F401
from numerics_survey import unfused_warnings  # noqa: E402
from test_eager_numerics import ReplayedTraining  # noqa: E402
from xla_helpers import FUSED, FUSED_STEP, executions, recorded_warnings  # noqa: E402

STEPS = 4


def train(backend: str, mesh: xs.Mesh) -> dict:
    torch._dynamo.reset()
    run = ReplayedTraining.build(backend, p=0.3)
    g = torch.Generator().manual_seed(1)
    execs, masks = [], []
    with recorded_warnings() as caught:
        for _ in range(STEPS):
            x, y = torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)
            xd, yd = x.to(torch_xla.device()), y.to(torch_xla.device())
            xs.mark_sharding(xd, mesh, ("data", None))
            xs.mark_sharding(yd, mesh, ("data", None))
            xm.mark_step()
            e0 = executions()
            _, h = run.xla_step(xd, yd)
            execs.append(executions() - e0)
            run.cpu_step(x, y, h)
            masks.append(run.replay.mask)
        want = run.reference.state_dict()
        state_err = max(
            (v.cpu().double() - want[k].double()).abs().max().item() for k, v in run.model.state_dict().items()
        )
        torch._dynamo.reset()
        x = (torch.rand(4096) + 0.5).to(torch_xla.device()).requires_grad_()
        xs.mark_sharding(x, mesh, ("data",))
        out = torch.compile(lambda t: F.dropout(t, 0.1, training=True), backend=backend)(x)
        out.sum().backward()
        xm.mark_step()
        out, grad, xc = out.detach().cpu(), x.grad.cpu(), x.detach().cpu()
        kept = out != 0
    return {
        "executions": execs,
        "state_err": state_err,
        "fresh_masks": all(not torch.equal(a, b) for a, b in zip(masks, masks[1:])),
        "unfused_warnings": unfused_warnings(caught),
        "dropout_scale_ok": bool(torch.allclose(out, xc * kept / 0.9, rtol=1e-6, atol=0)),
        "dropout_grad_ok": bool(torch.allclose(grad, kept.float() / 0.9, rtol=1e-6, atol=0)),
        "dropout_kept": kept.float().mean().item(),
    }


def main(out_path: str) -> None:
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    result = {"devices": n, **{b: train(b, mesh) for b in (FUSED, FUSED_STEP)}}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
