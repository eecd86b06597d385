"""torch_xla's FSDPv2 compiled as users write it, on a 4-device PJRT CPU mesh, for test_fsdpv2.py.

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python test/fsdpv2_checks.py OUT.json [--steps N]

``torch.compile(SpmdFullyShardedDataParallel(model), backend=B)`` (mesh (4, 1)
named ("fsdp", "model"), inputs sharded on "fsdp") around a 4-block pre-norm
MLP, AdamW, ``xm.mark_step()`` per step; with and without the blocks under
``torch.utils.checkpoint(use_reentrant=False)``; against uncompiled lazy SPMD
of the same model without checkpointing (the same math: lazy SPMD rejects
non-reentrant checkpointing). Writes, per run, the executions of each phase
[forward, backward, optimizer] per step (after ``xm.wait_device_ops()``),
the losses, ``UncachedCompile`` after each step and the output's sharding.
Also prints them as the table in docs/spmd.md. Then, per fused backend, the
annotations inside a compiled forward that lazy SPMD and dynamo treat
differently (``bad_input``) and a batch whose layout alternates
(``layout_changes``).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any, Callable, Optional

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

# --bridge-first: the package imported before torch_xla, so it cannot replace mark_sharding at
# import; the backend's first graph must, before dynamo reaches FSDPv2's output annotation.
BRIDGE_FIRST = "--bridge-first" in sys.argv
if BRIDGE_FIRST:
    import torch_xla_bridge.spmd_tracing  # noqa: E402

    assert "torch_xla" not in sys.modules and not torch_xla_bridge.spmd_tracing.installed()

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before anything touches a device

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel  # noqa: E402

import torch_xla_bridge  # noqa: E402,F401  (installs spmd_tracing, unless imported first)
from torch_xla_bridge import counting, spmd_tracing  # noqa: E402

WIDTH, HIDDEN, BLOCKS, BATCH = 64, 256, 4, 8
BACKENDS = ("openxla_fused_step", "openxla_fused_grad", "openxla")


class Block(nn.Module):
    """Pre-norm MLP block with a residual; optionally under non-reentrant activation checkpointing."""

    def __init__(self, checkpoint: bool) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class Model(nn.Module):
    """A user-defined model class, as HF models are (dynamo traces its forward as one frame)."""

    def __init__(self, checkpoint: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(checkpoint) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def mesh() -> xs.Mesh:
    n = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))


def run(
    backend: "str | None", checkpoint: bool, steps: int, compiled_optimizer: bool = False,
    module: Optional[Callable[[], nn.Module]] = None,
) -> dict[str, Any]:
    """``steps`` training steps of FSDPv2(Model), compiled whole with ``backend`` (None: lazy SPMD);
    ``compiled_optimizer``: ``opt.step`` compiled with it too; ``module``: makes the wrapped module instead."""
    torch._dynamo.reset()
    m = mesh()
    torch.manual_seed(0)
    inner = module() if module is not None else Model(checkpoint)
    wrapped = SpmdFullyShardedDataParallel(inner.to(torch_xla.device()), mesh=m)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    model = wrapped if backend is None else torch.compile(wrapped, backend=backend)
    opt_step = torch.compile(opt.step, backend=backend) if compiled_optimizer else opt.step
    g = torch.Generator().manual_seed(1)
    out: dict[str, list] = {"phases": [], "losses": [], "uncached_compiles": [], "output_spec": []}
    for _ in range(steps):
        x = torch.randn(BATCH, WIDTH, generator=g).to(torch_xla.device())
        xs.mark_sharding(x, m, ("fsdp", None))
        e0 = counting.executions()
        y = model(x)
        loss = y.pow(2).mean()
        e1 = counting.executions()
        loss.backward()
        e2 = counting.executions()
        opt_step()
        opt.zero_grad()
        xm.mark_step()
        e3 = counting.executions()
        out["phases"].append([e1 - e0, e2 - e1, e3 - e2])
        out["losses"].append(loss.item())
        out["uncached_compiles"].append(counting.counter("UncachedCompile"))
        out["output_spec"].append(torch_xla._XLAC._get_xla_sharding_spec(y))
    spec = torch_xla._XLAC._get_xla_sharding_spec
    out["param_specs"] = [spec(p) for p in wrapped.parameters()]
    out["state_specs"] = [[spec(opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")] for p in wrapped.parameters()]
    return out


class Annotated(nn.Module):
    """Linear, GELU, Linear with ``xs.mark_sharding`` (or another annotation) inside the forward, as ``how`` says."""

    def __init__(self, mesh: xs.Mesh, how: str) -> None:
        super().__init__()
        self.mesh, self.how = mesh, how
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        if self.how == "activation":  # mid-forward: splits the graph; the activation is annotated in between
            xs.mark_sharding(h, self.mesh, ("fsdp", None))
        elif self.how == "custom":
            xs.annotate_custom_sharding(h, self.mesh, ("fsdp", None))
        elif self.how == "parameter":  # already sharded on "fsdp" along dim 0: torch_xla refuses
            xs.mark_sharding(self.fc2.weight, self.mesh, (None, "fsdp"))  # LINE: parameter annotation
        return self.fc2(h)


def bad_input(backend: str, how: str, steps: int = 3) -> dict[str, Any]:
    """Annotations inside the compiled forward: losses against the same model uncompiled (lazy SPMD),
    executions per step, and for a refused annotation the error and whether anything changed."""
    torch._dynamo.reset()
    m = mesh()
    dev = torch_xla.device()
    out: dict[str, Any] = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Annotated(m, how).to(dev)
        for p in model.parameters():
            xs.mark_sharding(p, m, ("fsdp",) + (None,) * (p.dim() - 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        fn = torch.compile(model, backend=backend) if compiled else model
        before = [p.cpu() for p in model.parameters()]
        g = torch.Generator().manual_seed(2)
        run: dict[str, list] = {"losses": [], "executions": []}
        for _ in range(steps):
            x = torch.randn(8, 16, generator=g).to(dev)
            xs.mark_sharding(x, m, ("fsdp", None))
            e0 = counting.executions()
            try:
                loss = fn(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                xm.mark_step()
            except RuntimeError as e:
                xm.mark_step()
                run["error"] = str(e)
                run["unchanged"] = all(torch.equal(a, p.cpu()) for a, p in zip(before, model.parameters()))
                run["grads"] = [p.grad is not None for p in model.parameters()]
                run["optimizer_state"] = len(opt.state)
                break
            run["executions"].append(counting.executions() - e0)
            run["losses"].append(loss.item())
        out["compiled" if compiled else "lazy"] = run
    return out


def layout_changes(backend: str) -> dict[str, Any]:
    """A compiled model whose batch alternates between two layouts: the warnings it gives, and its gradients
    against the same model uncompiled."""
    import warnings

    torch._dynamo.reset()
    m = mesh()
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(dev)
    ref = copy.deepcopy(model)
    fn = torch.compile(model, backend=backend)
    messages: list[str] = []
    errs: list[float] = []
    for i in range(6):
        x = torch.randn(8, 16).to(dev)
        xs.mark_sharding(x, m, ("fsdp", None) if i < 2 or i % 2 == 0 else (None, "fsdp"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn(x).sum().backward()
        ref(x).sum().backward()
        xm.mark_step()
        messages += [str(w.message) for w in caught if "sharded differently" in str(w.message)]
        errs.append(max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
        model.zero_grad()
        ref.zero_grad()
    return {"warnings": messages, "grad_err": errs}


class WithGradients(nn.Module):
    """Linear, ReLU, ``xs.mark_sharding_with_gradients`` of the activation, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.mesh = mesh()
        self.a, self.b = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = xs.mark_sharding_with_gradients(torch.relu(self.a(x)), self.mesh, ("fsdp", None))
        return self.b(h)


def shared_input(backend: str, steps: int = 4) -> dict[str, Any]:
    """A batch read by two compiled graphs (a graph break between them; as labels are read by a loss
    after a break in an HF model): losses and the largest parameter difference to the same model
    uncompiled (lazy SPMD) after each SGD step."""
    torch._dynamo.reset()
    m = mesh()
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)).to(dev)
    ref = copy.deepcopy(model)

    def loss_fn(net: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = net[1](net[0](x))
        torch._dynamo.graph_break()
        return (net[2](h) - labels).pow(2).mean()

    fn = torch.compile(lambda x, labels: loss_fn(model, x, labels), backend=backend)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    out: dict[str, list] = {"losses": [], "lazy_losses": [], "param_err": []}
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).to(dev)
        xs.mark_sharding(x, m, ("fsdp", None))
        for net, f, o, key in ((model, fn, opt, "losses"), (ref, lambda a, b: loss_fn(ref, a, b), ref_opt, "lazy_losses")):
            loss = f(x, x)
            loss.backward()
            o.step()
            o.zero_grad()
            xm.mark_step()
            out[key].append(loss.item())
        out["param_err"].append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    return out


def main(path: str, steps: int) -> None:
    if BRIDGE_FIRST:
        installed_before = spmd_tracing.installed()
        result = {"installed_before_compile": installed_before, "lazy": run(None, False, steps),
                  "openxla_fused_grad": run("openxla_fused_grad", False, steps)}
        with open(path, "w") as f:
            json.dump(result, f)
        return
    from torch_xla.distributed.spmd.xla_sharded_tensor import XLAShardedTensor

    probe = torch.zeros(4, 2).to(torch_xla.device())
    result: dict[str, Any] = {
        "devices": xr.global_runtime_device_count(),
        # Outside a trace mark_sharding is torch_xla's own: it returns the wrapper.
        "eager_returns_wrapper": isinstance(xs.mark_sharding(probe, mesh(), ("fsdp", None)), XLAShardedTensor),
        "lazy": run(None, False, steps),
    }
    for backend in BACKENDS:
        for checkpoint in (False, True):
            result[f"{backend}{'+ckpt' if checkpoint else ''}"] = run(backend, checkpoint, steps)
    for backend in BACKENDS[:2]:
        result[f"{backend}+compiled_opt"] = run(backend, False, steps, compiled_optimizer=True)
    for backend in BACKENDS:
        result[f"shared_input:{backend}"] = shared_input(backend)
    for backend in (None, *BACKENDS[:2]):
        result[f"with_gradients:{backend or 'lazy'}"] = run(backend, False, 3, module=WithGradients)
    for backend in BACKENDS[:2]:
        for how in ("activation", "custom", "parameter"):
            result[f"bad_input:{backend}:{how}"] = bad_input(backend, how)
        result[f"layout_changes:{backend}"] = layout_changes(backend)
    result["parameter_line"] = next(
        i + 1 for i, line in enumerate(open(__file__).read().splitlines()) if line.endswith("# LINE: parameter annotation")
    )
    xm.wait_device_ops()
    with open(path, "w") as f:
        json.dump(result, f)
    print_table(result)


def print_table(result: dict[str, Any]) -> None:
    """Executions per step after the first, [forward, backward, optimizer], and in the first; losses against lazy SPMD."""
    lazy = result["lazy"]["losses"]
    print("| run | executions per step from step 2 (fwd + bwd + opt) | max abs(loss - lazy SPMD) | first step off by > 1e-5 | step 1 | UncachedCompile after step 2 |")
    print("|---|---|---|---|---|---|")
    for name, run in result.items():
        if not isinstance(run, dict) or "phases" not in run:
            continue
        steady = {tuple(p) for p in run["phases"][1:]}
        phases = " / ".join(" + ".join(map(str, p)) for p in sorted(steady))
        diffs = [abs(a - b) for a, b in zip(run["losses"], lazy)]
        off = next((i + 1 for i, d in enumerate(diffs) if d > 1e-5), None)
        grew = run["uncached_compiles"][-1] - run["uncached_compiles"][1]
        first = " + ".join(map(str, run["phases"][0]))
        print(f"| {name} | {phases} | {max(diffs):.1e} | {off or '-'} | {first} | +{grew} |")


if __name__ == "__main__":
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 4
    main(sys.argv[1], steps)
