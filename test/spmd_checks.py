"""SPMD training runs on a 4-device PJRT CPU mesh, for test_spmd.py.

SPMD must be switched on before the first use of an XLA device, and the pytest
process already uses XLA without it, so this runs as its own process:

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python test/spmd_checks.py OUT.json

It trains the same models with ``openxla_fused_grad``, upstream ``openxla``
and eager CPU and writes what test_spmd.py asserts on (executions per phase,
losses, parameters, gradient shardings, compile counters) as JSON.
"""

from __future__ import annotations

import copy
import json
import os
import sys
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
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

import torch_xla_bridge  # noqa: E402,F401
from xla_helpers import FUSED, FUSED_STEP, UPSTREAM, counter, cpu_state, device, make_model, mlp_task, train  # noqa: E402

STEPS = 6


def data_mesh() -> xs.Mesh:
    n = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n,), ("data",))


def shard_rows(mesh: xs.Mesh) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Data parallelism: the batch dimension of inputs and targets split over the mesh."""

    def shard(x: torch.Tensor, y: torch.Tensor) -> None:
        xs.mark_sharding(x, mesh, ("data", None))
        xs.mark_sharding(y, mesh, ("data", None))

    return shard


def shard_params(model: nn.Module, mesh: xs.Mesh) -> nn.Module:
    """FSDP-style: each parameter split over the mesh along its largest dimension.

    The rule SpmdFullyShardedDataParallel applies (``shard_maximal=True``).
    """
    model.to(device())
    for p in model.parameters():
        spec: list[Any] = [None] * p.dim()
        spec[list(p.shape).index(max(p.shape))] = "data"
        xs.mark_sharding(p, mesh, tuple(spec))
    return model


def specs(tensors) -> list[str]:
    return [torch_xla._XLAC._get_xla_sharding_spec(t) for t in tensors]


def state_json(model: nn.Module) -> dict[str, list]:
    return {k: v.tolist() for k, v in cpu_state(model).items()}


def training(backend: str, fsdp: bool, compiled_optimizer: bool = True) -> dict[str, Any]:
    """``STEPS`` steps: zero_grad(set_to_none=False), compiled forward, SGD(momentum) step
    (compiled with the same backend, or eager followed by ``xm.mark_step()``)."""
    torch._dynamo.reset()
    mesh = data_mesh()
    task = mlp_task()
    model = shard_params(make_model(task), mesh) if fsdp else None
    run = train(
        task,
        backend,
        steps=STEPS,
        set_to_none=False,
        compiled_optimizer=compiled_optimizer,
        model=model,
        shard_batch=shard_rows(mesh),
    )
    params = list(run.model.parameters())
    return {
        "phases": [[s.forward, s.backward, s.optimizer] for s in run.steps],
        "losses": [s.loss for s in run.steps],
        "grads_pending": [s.grads_pending for s in run.steps],
        "uncached_compiles": run.uncached_compiles,
        "state": state_json(run.model),
        "param_specs": specs(params),
        "grad_specs": specs([p.grad for p in params]),
    }


def eager_cpu() -> dict[str, Any]:
    run = train(mlp_task(), None, steps=STEPS, set_to_none=False, on_xla=False)
    return {"losses": [s.loss for s in run.steps], "state": state_json(run.model)}


def sharding_changes() -> dict[str, Any]:
    """Gradients per step while the batch layout changes: A for 7 steps (past upstream's
    threshold of 5 unchecked calls), then B, then A again; compared with eager CPU."""
    mesh_a = data_mesh()
    mesh_b = xs.Mesh(np.arange(4), (2, 2), ("a", "b"))
    layouts = [("A", mesh_a, ("data", None))] * 7 + [("B", mesh_b, ("b", "a"))] * 3
    layouts += [("A", mesh_a, ("data", None))] * 2
    torch._dynamo.reset()
    task = mlp_task()
    cpu_model = make_model(task)
    model = make_model(task).to(device())
    fwd = torch.compile(lambda x, y: task.loss(model(x), y), backend=FUSED)
    g = torch.Generator().manual_seed(7)
    out: dict[str, list] = {"layout": [], "input_spec": [], "grad_err": [], "uncached_compiles": []}
    for name, mesh, spec in layouts:
        x_cpu, y_cpu = task.make_batch(g)
        x, y = x_cpu.to(device()), y_cpu.to(device())
        xs.mark_sharding(x, mesh, spec)
        xs.mark_sharding(y, mesh, spec)
        model.zero_grad(set_to_none=True)
        cpu_model.zero_grad(set_to_none=True)
        fwd(x, y).backward()
        task.loss(cpu_model(x_cpu), y_cpu).backward()
        err = max(
            (p.grad.cpu() - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), cpu_model.parameters(), strict=True)
        )
        out["layout"].append(name)
        out["input_spec"].append(torch_xla._XLAC._get_xla_sharding_spec(x))
        out["grad_err"].append(err)
        out["uncached_compiles"].append(counter("UncachedCompile"))
    return out


def in_flight() -> dict[str, Any]:
    """Results in flight. Reading a placeholder's buffer handle crashed torch_xla 2.9 under SPMD (it reads a
    first shard the placeholder does not have yet; HF Trainer's FSDPv2 step hit it under load); handles
    are read once the buffer is there, and the fold keys device data by lazy tensor, the same before and
    after. Then fused steps of 3 micro-batches, each launched right after the parameters' update,
    compared with the same steps on CPU."""
    from torch_xla_bridge import _private, names

    torch._dynamo.reset()
    mesh = data_mesh()
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    model = copy.deepcopy(cpu_model).to(device())
    params = list(model.parameters())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, cpu_model)]
    step = torch.compile(lambda x, y: F.mse_loss(model(x), y) / 3, backend=FUSED_STEP)
    big = torch.randn(2048, 2048).to(device())
    xs.mark_sharding(big, mesh, ("data", None))

    def launch_slow_update() -> None:
        slow = (big @ big.T @ big).mean() * 0  # the parameters' values unchanged, their buffers late
        with torch.no_grad():
            for p in params:
                p.add_(slow)
        torch_xla._XLAC._xla_sync_multi(params, devices=[], wait=False, sync_xla_data=True)

    # A result just launched is a placeholder until its execution's buffers are assigned (on PJRT CPU when
    # the launch returns: a short window, so it is read at once, and tried again where a busy machine
    # scheduled the launch first; the steps below hit it by chance).
    out: dict[str, Any] = {"key_checks_in_flight": 0, "same_keys": True, "folds": [], "param_err": []}
    for _ in range(20):
        fresh = big @ big.T
        torch_xla._XLAC._xla_sync_multi([fresh], devices=[], wait=False, sync_xla_data=True)
        if not torch_xla._XLAC._is_placecholder(fresh):
            continue
        key, handle = _private.tensor_id(fresh), _private.buffer_handles([fresh])[0]  # waits for it
        out["key_checks_in_flight"] += 1
        out["same_keys"] &= key == _private.tensor_id(fresh) and handle == _private.buffer_handles([fresh])[0]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        folds = counter(names.FOLD_COUNTER)
        launch_slow_update()
        for _ in range(3):
            x_cpu, y_cpu = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
            x, y = x_cpu.to(device()), y_cpu.to(device())
            xs.mark_sharding(x, mesh, ("data", None))
            step(x, y).backward()
            (F.mse_loss(cpu_model(x_cpu), y_cpu) / 3).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        xm.wait_device_ops()
        out["folds"].append(counter(names.FOLD_COUNTER) - folds)
        out["param_err"].append(max((p.cpu() - q).abs().max().item() for p, q in zip(params, cpu_model.parameters())))
    return out


def main(path: str) -> None:
    # The XLA runtime comes up before the first CPU backward (the autograd
    # engine sizes its device queues then).
    devices = xr.global_runtime_device_count()
    result = {
        "devices": devices,
        "spmd": xr.is_spmd(),
        "cpu": eager_cpu(),
        "dp": {b: training(b, fsdp=False) for b in (FUSED, UPSTREAM)},
        "dp_eager_opt": {b: training(b, fsdp=False, compiled_optimizer=False) for b in (FUSED, UPSTREAM)},
        "fsdp": {b: training(b, fsdp=True) for b in (FUSED, UPSTREAM)},
        "changes": sharding_changes(),
        "in_flight": in_flight(),
    }
    xm.wait_device_ops()
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
