"""torch_xla's FSDPv2 (SpmdFullyShardedDataParallel) compiled whole, as HF Trainer's ``xla_fsdp_v2`` writes it.

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python examples/train_fsdpv2.py --backend openxla_fused_step --checkpoint
    PJRT_DEVICE=TPU python examples/train_fsdpv2.py --backend openxla_fused_step

One process drives every device: parameters are sharded over the mesh's "fsdp"
axis by the wrapper, the batch is split over it, and the model is compiled as
``torch.compile(SpmdFullyShardedDataParallel(model), backend=...)``.
``--checkpoint`` puts every block under ``torch.utils.checkpoint(...,
use_reentrant=False)``. ``--backend eager`` runs the same loop without
torch.compile (plain SPMD LazyTensor), the reference the tests compare with;
lazy SPMD rejects non-reentrant checkpointing, so it runs without it (the same
math). Prints the losses and the executions of each step as JSON last.
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
import torch.utils.checkpoint  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int, checkpoint: bool) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class Model(nn.Module):
    """A model class of its own (as HF models are): dynamo compiles its forward as one graph."""

    def __init__(self, width: int, blocks: int, checkpoint: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, checkpoint) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def executions() -> int:
    xm.wait_device_ops()
    return sum((met.metric_data(m) or (0,))[0] for m in ("ExecuteTime", "ExecuteReplicatedTime"))


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="openxla_fused_step", help="a torch.compile backend, or eager")
    ap.add_argument("--checkpoint", action="store_true", help="non-reentrant activation checkpointing per block")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16, help="global batch, split over the devices")
    args = ap.parse_args(argv)

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    torch.manual_seed(0)
    checkpoint = args.checkpoint and args.backend != "eager"
    model = SpmdFullyShardedDataParallel(Model(args.width, args.blocks, checkpoint).to(torch_xla.device()), mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.backend != "eager":
        model = torch.compile(model, backend=args.backend)

    g = torch.Generator().manual_seed(0)
    losses, per_step = [], []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, generator=g).to(torch_xla.device())
        y = torch.randint(0, 10, (args.batch,), generator=g).to(torch_xla.device())
        xs.mark_sharding(x, mesh, ("fsdp", None))
        xs.mark_sharding(y, mesh, ("fsdp",))
        before = executions()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        per_step.append(executions() - before)
        losses.append(loss.item())
        print(f"step {step + 1}: loss {losses[-1]:.5f}, {per_step[-1]} executions")
    print(json.dumps(dict(losses=losses, executions=per_step, devices=n)))
    return losses


if __name__ == "__main__":
    main()
