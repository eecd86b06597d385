"""Loops on which dynamo gives up part of the step, written as users write them, runnable in a subprocess.

Dynamo stops compiling a function after ``torch._dynamo.config.recompile_limit``
compilations (8 by default, 3 here so that a loop reaches it in a few steps):
a scheduler that changes a float of a compiled optimizer step (OneCycleLR's
``betas``), inputs of varying length fed to a compiled model. A region under
``torch._dynamo.disable`` runs eagerly from the start. ``python
fallback_loops.py BACKEND`` trains every loop of :data:`LOOPS` in one process
(dynamo reset in between) and prints ``{loop: record}`` (see
:class:`user_loops.Run`) as the last line of stdout; ``BACKEND`` ``eager`` runs
them on the CPU, the numerics reference.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Callable, Iterator, Optional

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from user_loops import Record, Run, _data, _mlp  # noqa: E402

LOOPS: dict[str, Callable[..., Record]] = {}
RECOMPILE_LIMIT = 3
LENGTHS = list(range(4, 10))  # six lengths: three compiled, then three the model runs eagerly


def loop(fn: Callable[..., Record]) -> Callable[..., Record]:
    LOOPS[fn.__name__] = fn
    return fn


@contextlib.contextmanager
def recompile_limit(limit: int) -> Iterator[None]:
    before = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = limit
    try:
        yield
    finally:
        torch._dynamo.config.recompile_limit = before


# First: the model of which dynamo compiles no graph runs before any dynamo reset (see main).
class _Squash(nn.Module):
    """A block the user keeps out of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    @torch._dynamo.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * 2


class _WithSquash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.inp = nn.Linear(8, 16)
        self.squash = _Squash()
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dynamo breaks the graph at the disabled block and resumes after it: two graphs, eager ops between.
        return self.out(torch.relu(self.squash(torch.relu(self.inp(x)))))


def _train_squash(r: Run, model: nn.Module, steps: int) -> Record:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fwd = r.compile(model)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(fwd(_data(40 + i, 4, 8).to(r.device)), _data(80 + i, 4, 1).to(r.device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        r.end_iteration()
    return r.record({"model": model}, values=losses)


@loop
def sequential_with_disabled_block(backend: Optional[str], device: str = "xla", steps: int = 5) -> Record:
    """An ``nn.Sequential`` with a block under ``torch._dynamo.disable``: dynamo cannot resume inside its
    ``for`` loop, so it compiles no graph of the model (it all runs eagerly), eager AdamW, no sync."""
    r = Run(backend, device)
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), _Squash(), nn.ReLU(), nn.Linear(16, 1)).to(r.device)
    return _train_squash(r, model, steps)


@loop
def disabled_block(backend: Optional[str], device: str = "xla", steps: int = 5) -> Record:
    """A model whose forward calls a block under ``torch._dynamo.disable`` between two compiled graphs, eager AdamW."""
    r = Run(backend, device)
    return _train_squash(r, _WithSquash().to(r.device), steps)


@loop
def onecycle_compiled_adamw(backend: Optional[str], device: str = "xla", steps: int = 9) -> Record:
    """``AdamW(lr=tensor)`` + OneCycleLR (``cycle_momentum`` rewrites ``betas[0]``, a float, every step),
    ``opt.step`` compiled: dynamo compiles the step anew each iteration until it gives up on it."""
    r = Run(backend, device)
    model = _mlp(16, 32, 4, seed=5).to(r.device)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=steps + 1)
    fwd, step = r.compile(model), r.compile(opt.step)
    losses = []
    with recompile_limit(RECOMPILE_LIMIT):
        for i in range(steps):
            opt.zero_grad()
            loss = F.mse_loss(fwd(_data(i, 8, 16).to(r.device)), _data(300 + i, 8, 4).to(r.device))
            loss.backward()
            step()
            sched.step()
            losses.append(loss.item())  # read after the step, as users log
            r.end_iteration()
    step_devices = sorted({str(st["step"].device.type) for st in opt.state.values()})
    return r.record({"model": model}, values=losses, step_devices=step_devices)


class _Tagger(nn.Module):
    """Token ids of any length -> per-token logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.emb = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.emb(tokens))))


def _varying_lengths(backend: Optional[str], device: str, compiled_optimizer: bool) -> Record:
    r = Run(backend, device)
    model = _Tagger().to(r.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fwd = r.compile(model)
    step = r.compile(opt.step) if compiled_optimizer else opt.step
    gen = torch.Generator().manual_seed(7)
    losses = []
    with recompile_limit(RECOMPILE_LIMIT):
        for _ in range(2):  # two passes over a dataset not padded to one length
            for length in LENGTHS:
                tokens = torch.randint(0, 32, (2, length), generator=gen).to(r.device)
                opt.zero_grad()
                loss = F.cross_entropy(fwd(tokens).flatten(0, 1), tokens.roll(-1, dims=1).flatten())
                loss.backward()
                step()
                r.end_iteration()
                losses.append(loss)
    return r.record({"model": model}, values=[v.item() for v in losses])  # read at the end: nothing syncs in the loop


@loop
def varying_lengths(backend: Optional[str], device: str = "xla") -> Record:
    """A compiled model fed batches of six lengths in turn, eager AdamW, no sync: dynamo runs three eagerly."""
    return _varying_lengths(backend, device, compiled_optimizer=False)


@loop
def varying_lengths_compiled_optimizer(backend: Optional[str], device: str = "xla") -> Record:
    """As :func:`varying_lengths`, with ``opt.step`` compiled too."""
    return _varying_lengths(backend, device, compiled_optimizer=True)


# Explained runs (``python fallback_loops.py explain``): each loop under a backend that runs it to the end
# (upstream openxla crashes on the varying lengths: a deleted buffer in its second pass).
EXPLAINED = {"onecycle_compiled_adamw": "openxla", "varying_lengths": "openxla_fused_grad"}


def explain_all() -> dict[str, Any]:
    """Each loop of :data:`EXPLAINED` run under ``torch_xla_bridge.explain``: its report and its record."""
    from torch_xla_bridge.explain import explain

    out = {}
    for name, backend in EXPLAINED.items():
        torch._dynamo.reset()
        with explain() as ex:
            rec = LOOPS[name](backend)
        out[name] = {"report": ex.report.to_dict(), "record": rec}
    return out


def main(argv: list[str]) -> None:
    if argv[0] == "explain":
        print(json.dumps(explain_all()))
        return
    backend = None if argv[0] == "eager" else argv[0]
    records = {}
    for i, (name, fn) in enumerate(LOOPS.items()):
        if i:  # the first loop (a model of which dynamo compiles no graph) runs as in a fresh process
            torch._dynamo.reset()
        records[name] = fn(backend, "cpu" if backend is None else "xla")
    print(json.dumps(records))


if __name__ == "__main__":
    main(sys.argv[1:])
