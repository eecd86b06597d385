"""Training steps abandoned by an exception, then training going on, runnable in a subprocess.

A user's exception inside a step (an assertion, a KeyboardInterrupt, a
notebook cell that raises) leaves the step's work pending. ``python
exception_loops.py BACKEND`` runs every case of :data:`CASES` in one process:
a model with BatchNorm (state the forward writes) trains four steps, the
second raising at one point of the step, caught as a notebook or a retry loop
catches it; then a second model trains three steps in the same process. It
prints ``{case: record}`` as the last line of stdout; ``BACKEND`` ``eager``
runs the cases on the CPU, the numerics reference (the same exceptions at the
same points).

``raise_at`` is where the second step raises: ``forward`` (after the loss),
``backward`` (a gradient hook), ``between`` (after backward, before the
optimizer), ``optimizer_pre`` / ``optimizer_post`` (an optimizer step hook,
before or after the update), ``none`` (the baseline). Each is run with the
optimizer eager and compiled with the backend.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Optional

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from user_loops import Record, Run, _data  # noqa: E402

RAISE_AT = ("none", "forward", "backward", "between", "optimizer_pre", "optimizer_post")
RAISING_STEP = 1


class Abandoned(Exception):
    """The user's exception: raised inside a step, caught outside it."""


def _bn_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def _raise(*args: Any) -> None:
    raise Abandoned()


def _train(r: Run, model: nn.Module, steps: int, compiled_optimizer: bool, raise_at: str) -> list[Optional[float]]:
    """``steps`` steps of the usual loop; step :data:`RAISING_STEP` raises at ``raise_at``
    (its loss is recorded as None)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fwd = r.compile(model)
    step = r.compile(opt.step) if compiled_optimizer else opt.step
    losses: list[Optional[float]] = []
    for i in range(steps):
        x = _data(i, 4, 8).to(r.device)
        y = _data(100 + i, 4, 4).to(r.device)
        at = raise_at if i == RAISING_STEP else "none"
        hooks = []
        if at == "backward":
            hooks.append(model[0].weight.register_hook(_raise))
        elif at == "optimizer_pre":
            hooks.append(opt.register_step_pre_hook(_raise))
        elif at == "optimizer_post":
            hooks.append(opt.register_step_post_hook(_raise))
        opt.zero_grad()
        try:
            loss = F.mse_loss(fwd(x), y)
            if at == "forward":
                _raise()
            loss.backward()
            if at == "between":
                _raise()
            step()
            losses.append(loss.item())
        except Abandoned:
            losses.append(None)
        finally:
            for h in hooks:
                h.remove()
        r.end_iteration()
    return losses


def run_case(backend: Optional[str], raise_at: str, compiled_optimizer: bool) -> Record:
    """The abandoned model, then a second model trained in the same process."""
    r = Run(backend, "xla" if backend else "cpu")
    first = _bn_mlp(1).to(r.device)
    second = _bn_mlp(2).to(r.device)
    values = dict(
        first=_train(r, first, 4, compiled_optimizer, raise_at),
        second=_train(r, second, 3, compiled_optimizer, "none"),
    )
    return r.record(dict(first=first, second=second), values)


CASES: dict[str, Callable[[Optional[str]], Record]] = {
    f"{at}/{'compiled' if compiled else 'eager'}_optimizer":
        (lambda backend, at=at, compiled=compiled: run_case(backend, at, compiled))
    for compiled in (False, True) for at in RAISE_AT
}


def _backward_inside(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    pred = model(x)
    F.mse_loss(pred, y).backward()
    return pred


def backward_inside_read_output(backend: Optional[str]) -> Record:
    """The backward inside the compiled function, its output read, no optimizer and no sync
    (pytorch/xla's own training test): gradients and BatchNorm statistics accumulate over the calls."""
    r = Run(backend, "xla" if backend else "cpu")
    model = _bn_mlp(3).to(r.device)
    fn = r.compile(_backward_inside)
    outs = []
    for i in range(5):
        out = fn(model, _data(i, 4, 8).to(r.device), _data(100 + i, 4, 4).to(r.device))
        outs.append(out.sum().item())
        r.end_iteration()
    grads = {f"grad.{n}": p.grad.cpu().tolist() for n, p in model.named_parameters()}
    return r.record(dict(model=model), dict(outputs=outs, **grads))


def _sin_cos(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.cos(x) + torch.sin(y)


def abandoned_forward_then_inference(backend: Optional[str]) -> Record:
    """Forwards of a model whose parameters require grad, read and never differentiated (an
    evaluation without ``no_grad``, then an assertion fails); then a compiled function of
    pending inputs executes them with its output at its call, as it does in a fresh process."""
    r = Run(backend, "xla" if backend else "cpu")
    model = _bn_mlp(4).to(r.device).eval()
    fwd = r.compile(model)
    outs = []
    try:
        for i in range(2):
            outs.append(fwd(_data(i, 4, 8).to(r.device)).sum().item())
            r.end_iteration()
        raise Abandoned()
    except Abandoned:
        pass
    fn = r.compile(_sin_cos)
    x = _data(7, 3).to(r.device)
    y = _data(8, 3).to(r.device)
    out = fn(x + 1, y * 3)
    r.end_iteration()
    executed_at_call = r.per_iteration[-1]
    return r.record(dict(model=model), dict(outputs=outs, after=out.cpu().tolist()), executed_at_call=executed_at_call)


CASES["backward_inside/read_output"] = backward_inside_read_output
CASES["abandoned_forward/then_inference"] = abandoned_forward_then_inference


def main(argv: list[str]) -> None:
    backend = None if argv[0] == "eager" else argv[0]
    results = {}
    for name, case in CASES.items():
        torch._dynamo.reset()
        results[name] = case(backend)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
