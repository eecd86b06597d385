"""The replayed step under SPMD on a 4-device PJRT CPU mesh, for test_replay.py.

SPMD must be on before the first use of an XLA device, so this runs as its own process:

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python test/spmd_replay_checks.py OUT.json

It trains an MLP whose parameters are sharded FSDP-style (each over the mesh along its
largest dimension) on batches sharded over their rows, as a loop traced on every call
and as the same loop under ``@torch_xla_bridge.replayed_step``, and on eager CPU; at
call 7 the batch comes in replicated (a sharding change). Then FSDPv2
(``SpmdFullyShardedDataParallel``, compiled whole) with AdamW(capturable=True) and a tensor lr
that a LambdaLR sets after every call, traced and replayed. It writes what the test asserts on: executions per call, captures and replays,
losses, parameters, shardings, compiles.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from typing import Any, Callable

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before anything touches a device

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

import torch_xla_bridge  # noqa: E402
from test_replay import trainer  # noqa: E402  (the loop as users write it)
from xla_helpers import counter, executions, names  # noqa: E402

CALLS, RESHARDED_AT = 9, 6  # the 7th call's batch is replicated


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(CALLS)]


def specs(tensors: list[torch.Tensor]) -> list[str]:
    return [torch_xla._XLAC._get_xla_sharding_spec(t) for t in tensors]


def training(replayed: bool, cpu: nn.Module) -> dict[str, Any]:
    torch._dynamo.reset()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    m = copy.deepcopy(cpu).to(torch_xla.device())
    for p in m.parameters():
        spec: list[Any] = [None] * p.dim()
        spec[list(p.shape).index(max(p.shape))] = "data"
        xs.mark_sharding(p, mesh, tuple(spec))
    step, _ = trainer(m)  # SGD with momentum, the model compiled with the fused step
    fn: Callable[..., torch.Tensor] = torch_xla_bridge.replayed_step(step) if replayed else step
    losses, per_call, compiles = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (x, y) in enumerate(batches()):
            x, y = x.to(torch_xla.device()), y.to(torch_xla.device())
            if i != RESHARDED_AT:
                xs.mark_sharding(x, mesh, ("data", None))
                xs.mark_sharding(y, mesh, ("data", None))
            start = executions()
            loss = fn(x, y)
            per_call.append(executions() - start)
            losses.append(loss.item())
            compiles.append(counter(names.UNCACHED_COMPILE_COUNTER))
    params = list(m.parameters())
    return {
        "losses": losses, "per_call": per_call, "compiles": compiles,
        "captures": getattr(fn, "captures", None), "replays": getattr(fn, "replays", None),
        "warnings": [str(w.message) for w in caught if "replayed step" in str(w.message)],
        "params": [p.detach().cpu().tolist() for p in params],
        "param_specs": specs(params), "grad_specs": specs([p.grad for p in params]),
    }


def fsdpv2(replayed: bool) -> dict[str, Any]:
    """test/fsdpv2_checks.py's model under FSDPv2, compiled whole; AdamW keeps its step count on the device, its
    lr is a tensor that a scheduler sets after every call (an input of the replayed program)."""
    import fsdpv2_checks
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    torch._dynamo.reset()
    mesh = fsdpv2_checks.mesh()
    torch.manual_seed(0)
    wrapped = SpmdFullyShardedDataParallel(fsdpv2_checks.Model(False).to(torch_xla.device()), mesh=mesh)
    step, opt = trainer(wrapped, optimizer=lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), capturable=True))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    fn: Callable[..., torch.Tensor] = torch_xla_bridge.replayed_step(step) if replayed else step
    g = torch.Generator().manual_seed(1)
    losses, per_call = [], []
    for _ in range(6):
        x, y = (torch.randn(fsdpv2_checks.BATCH, fsdpv2_checks.WIDTH, generator=g).to(torch_xla.device())
                for _ in range(2))
        xs.mark_sharding(x, mesh, ("fsdp", None))
        xs.mark_sharding(y, mesh, ("fsdp", None))
        start = executions()
        losses.append(fn(x, y).item())
        per_call.append(executions() - start)
        scheduler.step()
    params = list(wrapped.parameters())
    return {"losses": losses, "per_call": per_call, "replays": getattr(fn, "replays", None),
            "params": [p.detach().cpu().tolist() for p in params], "param_specs": specs(params)}


def eager_cpu(cpu: nn.Module) -> list[list]:
    opt = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches():
        opt.zero_grad(set_to_none=False)
        F.mse_loss(cpu(x), y).backward()
        opt.step()
    return [p.detach().tolist() for p in cpu.parameters()]


def main(path: str) -> None:
    cpu = model()
    result = {"devices": xr.global_runtime_device_count(), "traced": training(False, cpu),
              "replayed": training(True, cpu), "eager_cpu": eager_cpu(copy.deepcopy(cpu)),
              "fsdpv2_traced": fsdpv2(False), "fsdpv2_replayed": fsdpv2(True)}
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
