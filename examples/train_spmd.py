"""Sharded training with torch_xla's SPMD and fused gradients: one process drives every device.

The same script runs on a 4-device PJRT CPU mesh and, unchanged, on a TPU or GPU
slice (on a multi-host TPU slice, start it on every host: ``--worker=all``):

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python examples/train_spmd.py --layout data
    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python examples/train_spmd.py --layout params
    PJRT_DEVICE=TPU python examples/train_spmd.py --layout params

``--layout data`` splits the batch over the mesh (data parallelism);
``--layout params`` also splits every parameter along its largest dimension
(FSDP-style). ``--backend eager`` runs the same loop without torch.compile
(plain SPMD LazyTensor), the reference the tests compare with.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before anything touches a device

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="openxla_fused_grad", help="a torch.compile backend, or eager")
    ap.add_argument("--layout", choices=("data", "params"), default="data")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32, help="global batch, split over the devices")
    args = ap.parse_args(argv)

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    device = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    model.to(device)
    if args.layout == "params":
        for p in model.parameters():
            spec: list = [None] * p.dim()
            spec[list(p.shape).index(max(p.shape))] = "data"
            xs.mark_sharding(p, mesh, tuple(spec))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    step_loss = loss_fn if args.backend == "eager" else torch.compile(loss_fn, backend=args.backend)

    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, 64, generator=g).to(device)
        y = torch.randint(0, 10, (args.batch,), generator=g).to(device)
        xs.mark_sharding(x, mesh, ("data", None))
        xs.mark_sharding(y, mesh, ("data",))
        optimizer.zero_grad()
        loss = step_loss(x, y)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        losses.append(loss.item())
        print(f"step {step + 1}: loss {losses[-1]:.5f}")
    grads_keep_sharding = all(
        torch_xla._XLAC._get_xla_sharding_spec(p) == torch_xla._XLAC._get_xla_sharding_spec(p.grad)
        for p in model.parameters()
    )
    print(json.dumps(dict(losses=losses, devices=n, grads_keep_sharding=grads_keep_sharding)))
    return losses


if __name__ == "__main__":
    main()
