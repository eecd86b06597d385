"""A step inside ``torch_xla.compile(step_fn, full_graph=True)``, as pytorch/xla's examples write it.

``examples/train_decoder_only_base.py`` and ``examples/train_resnet_base.py``
(v2.9.0) wrap zero_grad, forward, backward and ``optimizer.step()`` in
``torch_xla.compile(..., full_graph=True)``, which forbids any execution until
the function returns and then syncs. ``openxla_fused_step`` leaves its cut to
that sync: one execution per step. A backend whose graphs execute at their
call cannot run there; it says so, and how to get on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch_xla

from xla_helpers import FUSED, FUSED_STEP, counter, device, executions, mlp

STEPS = 5
WARMUP = 2


def _train(model: torch.nn.Module, backend: str | None, full_graph: bool, compiled_optimizer: bool = False,
           steps: int = STEPS) -> tuple[list[float], list[int], list[int]]:
    """Losses, executions per step and ``UncachedCompile`` after each step."""
    dev = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    forward = torch.compile(model, backend=backend) if backend else model
    opt_step = torch.compile(opt.step, backend=backend) if compiled_optimizer else opt.step

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        opt_step()
        return loss

    if dev.type == "xla":
        step_fn = torch_xla.compile(step_fn, full_graph=full_graph)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=gen).to(dev), torch.randn(8, 4, generator=gen).to(dev)
    losses, per_step, compiles = [], [], []
    for _ in range(steps):
        before = executions()
        loss = step_fn(x, y)
        per_step.append(executions() - before)
        compiles.append(counter("UncachedCompile"))
        losses.append(loss.item())  # after the step's execution: reads a materialized value
    return losses, per_step, compiles


def _eager_cpu() -> list[float]:
    torch.manual_seed(0)
    return _train(mlp(), None, full_graph=False)[0]


@pytest.mark.parametrize("compiled_optimizer", [False, True], ids=["eager_optimizer", "compiled_optimizer"])
def test_fused_step_is_one_execution_per_step_inside_full_graph(compiled_optimizer):
    torch.manual_seed(0)
    model = mlp().to(device())
    losses, per_step, compiles = _train(model, FUSED_STEP, full_graph=True, compiled_optimizer=compiled_optimizer)
    assert per_step[WARMUP:] == [1] * (STEPS - WARMUP), per_step
    assert len(set(compiles[WARMUP:])) == 1, compiles
    assert losses == pytest.approx(_eager_cpu(), rel=1e-5, abs=1e-6)


def test_fused_grad_inside_full_graph_names_the_cause_and_the_way_out():
    torch.manual_seed(0)
    model = mlp().to(device())
    want = [p.detach().cpu().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"full_graph=True\) allows no execution.*backend='openxla_fused_step'"):
        _train(model, FUSED, full_graph=True, steps=1)
    # Nothing ran: the parameters are as before, and the way out named trains as eager CPU does.
    for p, w in zip(model.parameters(), want, strict=True):
        assert torch.equal(p.detach().cpu(), w)
    torch._dynamo.reset()
    losses, per_step, _ = _train(model, FUSED, full_graph=False)
    assert losses == pytest.approx(_eager_cpu(), rel=1e-5, abs=1e-6)
    # Forward, backward with its accumulation, the eager optimizer with torch_xla.compile's sync.
    assert per_step[WARMUP:] == [3] * (STEPS - WARMUP), per_step
