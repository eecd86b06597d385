"""The optimizers people compile, each trained as users write the loop, runnable in a subprocess.

``opt_step = torch.compile(opt.step, backend=B)`` beside the compiled model,
``zero_grad(set_to_none=True)``, no ``torch_xla.sync()`` (the step ends at the
optimizer step), a scheduler where the configuration has one. Every
configuration of :data:`OPTIMIZERS` trains in one process (dynamo reset in
between); ``python optimizer_loops.py BACKEND`` prints, per configuration, the
record of :class:`user_loops.Run` plus the XLA compilations of each iteration.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Optional

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from user_loops import Record, Run, _data  # noqa: E402

Optimizer = torch.optim.Optimizer
Scheduler = Optional[torch.optim.lr_scheduler.LRScheduler]
Factory = Callable[[list[nn.Parameter]], tuple[Optimizer, Scheduler]]


def _lambda_lr(opt: Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A new lr at every step (warm-up then decay), as schedulers give."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3) * 0.9**i)


# name -> optimizer (and scheduler) for the model's parameters. Step counts on the CPU
# (capturable=False, torch's default) for all but the capturable AdamW.
OPTIMIZERS: dict[str, Factory] = {
    "AdamW": lambda p: (torch.optim.AdamW(p, lr=1e-2), None),
    "AdamW(foreach=True)": lambda p: (torch.optim.AdamW(p, lr=1e-2, foreach=True), None),
    "Adam(amsgrad, weight_decay)": lambda p: (torch.optim.Adam(p, lr=1e-2, amsgrad=True, weight_decay=0.01), None),
    "RMSprop": lambda p: (torch.optim.RMSprop(p, lr=1e-3), None),
    "Adagrad": lambda p: (torch.optim.Adagrad(p, lr=1e-2), None),
    "AdamW(capturable=True)": lambda p: (torch.optim.AdamW(p, lr=1e-2, capturable=True), None),
    "SGD(nesterov)": lambda p: (torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True), None),
    # torch's idiom for a scheduler under torch.compile: lr a 0-dim tensor, filled by the scheduler.
    "AdamW(lr=tensor) + LambdaLR": lambda p: (lambda o: (o, _lambda_lr(o)))(
        torch.optim.AdamW(p, lr=torch.tensor(1e-2))
    ),
}


def train(name: str, backend: Optional[str], device: str = "xla", steps: int = 6) -> Record:
    """Trains a 3-layer MLP with ``OPTIMIZERS[name]``, model and optimizer step compiled with ``backend``."""
    r = Run(backend, device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(r.device)
    opt, sched = OPTIMIZERS[name](list(model.parameters()))
    m, opt_step = r.compile(model), r.compile(opt.step)
    losses = []
    for i in range(steps):
        x = _data(i, 8, 16).to(r.device)
        opt.zero_grad(set_to_none=True)
        loss = m(x).pow(2).mean()
        loss.backward()
        opt_step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        r.end_iteration()
    # Upstream's bridge warns for each CPU tensor it meets ("Found tensor ... on cpu").
    cpu_warnings = [str(w.message) for w in r.warnings if "on cpu" in str(w.message)]
    return r.record({"model": model}, values=losses, cpu_warnings=cpu_warnings)


def main(argv: list[str]) -> None:
    backend = argv[0]
    records: dict[str, Any] = {}
    for name in OPTIMIZERS:
        torch._dynamo.reset()
        records[name] = train(name, backend)
    print(json.dumps(records))


if __name__ == "__main__":
    main(sys.argv[1:])
