"""Training loops written the way users write them, runnable in a subprocess.

Each loop trains on XLA with a given backend (``None``: eager on the device
given) and returns a JSON-able record: the parameters after training (as
lists, for comparison with eager CPU), the losses, and the XLA executions of
every iteration after warm-up. ``python user_loops.py LOOP BACKEND [DEVICE]``
prints that record as the last line of stdout, so a test can run a loop that
might crash the process (a segfault, an abort) in a subprocess of its own.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any, Callable, Optional

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

Record = dict[str, Any]
LOOPS: dict[str, Callable[..., Record]] = {}


def loop(fn: Callable[..., Record]) -> Callable[..., Record]:
    LOOPS[fn.__name__] = fn
    return fn


class Run:
    """Device, compile and sync helpers shared by every loop; eager CPU when ``backend`` is None."""

    def __init__(self, backend: Optional[str], device: str = "xla") -> None:
        self.backend = backend
        self.on_xla = device == "xla"
        if self.on_xla:
            import torch_xla

            import torch_xla_bridge  # noqa: F401  (registers the backends)

            self.device = torch_xla.device()
        else:
            self.device = torch.device("cpu")
        self.per_iteration: list[int] = []
        self._mark = self.executions()
        self.caught = warnings.catch_warnings(record=True)
        self.warnings = self.caught.__enter__()
        warnings.simplefilter("always")

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, backend=self.backend) if self.backend else fn

    def sync(self) -> None:
        if self.on_xla:
            import torch_xla

            torch_xla.sync()

    def executions(self) -> int:
        if not self.on_xla:
            return 0
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        xm.wait_device_ops()
        return sum((met.metric_data(m) or (0,))[0] for m in ("ExecuteTime", "ExecuteReplicatedTime"))

    def end_iteration(self) -> None:
        now = self.executions()
        self.per_iteration.append(now - self._mark)
        self._mark = self.executions()

    def record(self, models: dict[str, nn.Module], **extra: Any) -> Record:
        self.caught.__exit__(None, None, None)
        params = {
            f"{m}.{k}": v.detach().cpu().tolist() for m, model in models.items() for k, v in model.state_dict().items()
        }
        ours = [str(w.message) for w in self.warnings if "openxla_fused" in str(w.message)]
        return dict(params=params, executions=self.per_iteration, warnings=ours, **extra)


def _data(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mlp(d_in: int, width: int, d_out: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, width), nn.Tanh(), nn.Linear(width, d_out))


@loop
def gan(backend: Optional[str], device: str = "xla", steps: int = 5) -> Record:
    """Two optimizers, D's grads not zeroed before G's backward (G's loss flows through D), one sync per iteration."""
    r = Run(backend, device)
    G = _mlp(8, 32, 16, seed=1).to(r.device)
    D = _mlp(16, 32, 1, seed=2).to(r.device)
    opt_g = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.9)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    g, d = r.compile(G), r.compile(D)
    losses = []
    for i in range(steps):
        real = _data(100 + i, 16, 16).to(r.device)
        z = _data(200 + i, 16, 8).to(r.device)
        opt_d.zero_grad()
        fake = g(z)
        loss_d = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = F.softplus(-d(fake)).mean()
        loss_g.backward()  # accumulates into D's .grad too, read by nobody until the next zero_grad
        opt_g.step()
        r.sync()
        losses.append([loss_d.item(), loss_g.item()])
        r.end_iteration()
    return r.record({"G": G, "D": D}, losses=losses)


@loop
def accumulation_with_grad_norms(backend: Optional[str], device: str = "xla", steps: int = 4) -> Record:
    """Gradient accumulation over 4 micro-batches, logging a lazy ``.grad`` statistic after each backward."""
    r = Run(backend, device)
    model = _mlp(16, 32, 4, seed=3).to(r.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fwd = r.compile(model)
    logged = []
    for i in range(steps):
        norms = []
        for k in range(4):
            x = _data(10 * i + k, 8, 16).to(r.device)
            y = _data(1000 + 10 * i + k, 8, 4).to(r.device)
            (F.mse_loss(fwd(x), y) / 4).backward()
            norms.append(torch.stack([p.grad.norm() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
        r.sync()
        logged.append(torch.stack(norms).cpu().tolist())
        r.end_iteration()
    return r.record({"model": model}, logged=logged)


def _clip(backend: Optional[str], device: str, steps: int, set_to_none: bool) -> Record:
    r = Run(backend, device)
    model = _mlp(16, 32, 4, seed=4).to(r.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fwd, step = r.compile(model), r.compile(opt.step)
    norms = []
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        x = _data(i, 8, 16).to(r.device)
        y = _data(500 + i, 8, 4).to(r.device)
        F.mse_loss(fwd(x), y).backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        step()
        norms.append(total.item())  # read after the step: no sync of its own
        r.end_iteration()
    return r.record({"model": model}, norms=norms)


@loop
def clip_compiled_optimizer(backend: Optional[str], device: str = "xla", steps: int = 5) -> Record:
    """``clip_grad_norm_`` + optimizer compiled with the same backend, ``zero_grad(set_to_none=False)``."""
    return _clip(backend, device, steps, set_to_none=False)


@loop
def clip_compiled_optimizer_set_to_none(backend: Optional[str], device: str = "xla", steps: int = 5) -> Record:
    """As :func:`clip_compiled_optimizer`, with ``zero_grad(set_to_none=True)``."""
    return _clip(backend, device, steps, set_to_none=True)


def main(argv: list[str]) -> None:
    name, backend = argv[0], argv[1]
    device = argv[2] if len(argv) > 2 else "xla"
    rec = LOOPS[name](None if backend == "eager" else backend, device)
    print(json.dumps(rec))


if __name__ == "__main__":
    main(sys.argv[1:])
