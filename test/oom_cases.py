"""Training loops with one step too big for the machine, run one per process by test_out_of_memory.py.

``python test/oom_cases.py CASE`` trains an MLP with a BatchNorm (16 -> 512 -> 4, SGD with
momentum) on XLA and, beside it, on the CPU: 3 steps at batch 8, one step at a batch whose
program needs more than twice the machine's memory (RAM and swap: it fails at once, at its first
allocation), caught as a user catches it, then 3 more steps at batch 8, the CPU skipping the failed
step. Prints one JSON line (``RESULT {...}``): the error, the state before and after the failed step
compared bitwise, executions and compiles of the steps after it, and the largest difference from
eager CPU. Cases: ``eager`` (eager optimizer), ``compiled_optimizer``, ``accumulation`` (3
micro-batches per step), ``zero_grad_kept`` (``zero_grad(set_to_none=False)``), ``refused_at_compile``
(the step's sync raises as XLA's compiler does on TPU, RESOURCE_EXHAUSTED), ``fused_grad``
(``openxla_fused_grad``, no BatchNorm), ``spmd`` (refused at compile, as on TPU, under SPMD on the devices of
``CPU_NUM_DEVICES``, each batch sharded along its first dimension, parameters replicated).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

import torch_xla_bridge  # noqa: E402,F401
from torch_xla_bridge import counting, names  # noqa: E402

HIDDEN = 512
SMALL = 8
CASES = ("eager", "compiled_optimizer", "accumulation", "zero_grad_kept", "refused_at_compile", "fused_grad", "spmd")


def too_big_batch() -> int:
    """A batch whose hidden activations alone need twice the machine's RAM and swap (a power of 2)."""
    kib = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
           if line.startswith(("MemTotal:", "SwapTotal:"))}
    need = 2 * (kib["MemTotal"] + kib.get("SwapTotal", 0)) * 1024
    return 1 << (need // (HIDDEN * 4)).bit_length()


def model(batch_norm: bool = True) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(HIDDEN) if batch_norm else nn.Identity()
    return nn.Sequential(nn.Linear(16, HIDDEN), norm, nn.ReLU(), nn.Linear(HIDDEN, 4))


def state(m: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters, .grad, buffers and optimizer state, on the CPU (None for a missing .grad)."""
    out: dict[str, Any] = {}
    for name, p in m.named_parameters():
        out[name] = p.detach().cpu()
        out[name + ".grad"] = None if p.grad is None else p.grad.detach().cpu()
        for key, value in opt.state.get(p, {}).items():
            out[f"{name}.{key}"] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    for name, b in m.named_buffers():
        out[name] = b.detach().cpu()
    return out


def differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values are not bitwise equal (or present in one only)."""
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or (
        (a[k] is None) != (b[k] is None) or (isinstance(a[k], torch.Tensor) and not torch.equal(a[k], b[k]))
        or (not isinstance(a[k], torch.Tensor) and a[k] != b[k]))]


def main(case: str) -> None:
    place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    if case == "spmd":
        import numpy as np
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        xr.use_spmd()
        mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (xr.global_runtime_device_count(), 1))

        def place(t: torch.Tensor) -> torch.Tensor:
            xs.mark_sharding(t, mesh, (0, None))
            return t
    dev = torch_xla.device()
    # openxla_fused_grad's forward executes on its own, as upstream's: a refused one leaves the statistics it
    # writes holding XLA's error (docs/guide.md), so its case trains without BatchNorm.
    cpu = model(batch_norm=case != "fused_grad")
    xla = copy.deepcopy(cpu).to(dev)
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(xla.parameters(), lr=0.05, momentum=0.9)
    backend = names.BACKEND_NAME if case == "fused_grad" else names.STEP_BACKEND_NAME
    loss_fn = torch.compile(lambda x, y: F.mse_loss(xla(x), y), backend=backend)
    opt_step: Callable[[], Any] = opt.step
    if case == "compiled_optimizer":
        opt_step = torch.compile(opt.step, backend=names.STEP_BACKEND_NAME)
    micro = 3 if case == "accumulation" else 1
    set_to_none = case != "zero_grad_kept"

    def step(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        if not set_to_none:
            opt.zero_grad(set_to_none=False)
        losses = []
        for x, y in batches:
            loss = loss_fn(x, y) / len(batches)
            loss.backward()
            losses.append(loss)
            logged.append(loss)  # read later, as a user logs losses
        opt_step()
        if set_to_none:
            opt.zero_grad()
        return losses

    def cpu_step(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        losses = []
        for x, y in batches:
            loss = F.mse_loss(cpu(x), y) / len(batches)
            loss.backward()
            losses.append(loss.item())
        cpu_opt.step()
        cpu_opt.zero_grad(set_to_none=set_to_none)
        return losses

    g = torch.Generator().manual_seed(1)
    data = [[(torch.randn(SMALL, 16, generator=g), torch.randn(SMALL, 4, generator=g)) for _ in range(micro)]
            for _ in range(6)]
    diffs: list[float] = []
    logged: list[torch.Tensor] = []

    def both(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        xla_losses = step([(place(x.to(dev)), place(y.to(dev))) for x, y in batches])
        cpu_losses = cpu_step(batches)
        diffs.extend(abs(a.item() - b) / abs(b) for a, b in zip(xla_losses, cpu_losses))

    steady = []
    for batches in data[:3]:
        start = counting.executions()
        both(batches)
        xm.wait_device_ops()
        steady.append(counting.executions() - start)
    before, rng_before = state(xla, opt), xm.get_rng_state()

    big = too_big_batch()
    if case in ("refused_at_compile", "spmd"):
        real_sync = torch_xla.sync

        def refusing_sync(*args: Any, **kwargs: Any) -> None:
            torch_xla.sync = real_sync
            raise RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
                               "space hbm. Used 190.25G of 15.48G hbm. Exceeded hbm capacity by 174.77G.")

        torch_xla.sync = refusing_sync
    error, error_type, recognised = None, None, None
    try:
        step([(place(torch.zeros(big, 16, device=dev)), place(torch.zeros(big, 4, device=dev)))] * micro)
    except RuntimeError as e:
        # Only its text is kept: a kept exception keeps the step's inputs alive, pending (made on the device).
        error, error_type = str(e), type(e).__name__
        try:
            from accelerate.utils.memory import should_reduce_batch_size
            recognised = should_reduce_batch_size(e)
        except ImportError:
            pass
    xm.wait_device_ops()
    executions_before_read = counting.executions()
    after, rng_after = state(xla, opt), xm.get_rng_state()
    read_executions = counting.executions() - executions_before_read
    refused_losses = []  # what reading the refused step's own losses gives
    for loss in logged[-micro:]:
        try:
            refused_losses.append(repr(loss.item()))
        except RuntimeError as e:
            refused_losses.append(str(e).splitlines()[0])
    del logged[-micro:], loss

    per_step, compiles = [], counting.counter(names.UNCACHED_COMPILE_COUNTER)
    for batches in data[3:]:
        start = counting.executions()
        both(batches)
        xm.wait_device_ops()
        per_step.append(counting.executions() - start)
    compiled_after = counting.counter(names.UNCACHED_COMPILE_COUNTER) - compiles
    params = max((p.detach().cpu() - q.detach()).abs().max().item() for p, q in zip(xla.parameters(), cpu.parameters()))

    print("RESULT " + json.dumps(dict(
        big_batch=big, backend=backend, steady_before=steady[1:], error=error, error_type=error_type, refused_losses=refused_losses,
        accelerate_reduces_batch=recognised, changed=differing(before, after), rng_kept=rng_before == rng_after,
        read_executions=read_executions, per_step=per_step, compiled_after=compiled_after,
        loss_diff=max(diffs), param_diff=params,
        grads_after={k: bool(v.eq(0).all()) for k, v in after.items() if k.endswith(".grad") and v is not None},
    )), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    main(sys.argv[1])
