"""The first step traces the second step's graph, so each program compiles once (time to first step).

What differs between a training loop's first and second step is state: ``.grad``
is None at the first backward and a zero fill after ``zero_grad(set_to_none=False)``;
optimizer buffers are created by the first step; a BatchNorm counter moved to
the device with value 0 is a torch_xla constant. A fused graph holds all of it, so
each difference recompiled the whole fused program at the second step.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla.core.xla_model as xm

from xla_helpers import (
    FUSED,
    FUSED_STEP,
    counter,
    device,
    executions,
    mlp_task,
    names,
    train,
)
from test_fused_step import assert_same_training

STEPS = 4


def compiles_per_step(run) -> list[int]:
    """UncachedCompile per step after the first (the list holds the counter after each step)."""
    c = run.uncached_compiles
    return [b - a for a, b in zip(c, c[1:])]


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_grads"])
def test_fused_backward_compiles_once_whether_grads_are_none_or_zeroed(set_to_none):
    # Eager SGD without momentum and a sync: the optimizer has no state, so any
    # compile after the first step would be the backward's.
    kw = dict(steps=STEPS, optimizer="sgd", set_to_none=set_to_none, compiled_optimizer=False)
    ours = train(mlp_task(), FUSED, **kw)
    eager = train(mlp_task(), None, on_xla=False, **kw)
    assert compiles_per_step(ours) == [0] * (STEPS - 1)
    assert [r.total for r in ours.steps[1:]] == [3] * (STEPS - 1)  # forward, backward + accumulation, the step
    assert_same_training(ours, eager, rtol=1e-5, atol=1e-6)


class WithUnusedParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_a_parameter_without_gradient_keeps_grad_none(backend):
    model = WithUnusedParameter().to(device())
    x = torch.randn(3, 4).to(device())
    torch.compile(lambda x: model(x).sum(), backend=backend)(x).backward()
    assert model.unused.weight.grad is None and model.unused.bias.grad is None
    want = x.cpu().sum(0).expand(2, 4)
    torch.testing.assert_close(model.used.weight.grad.cpu(), want)
    torch.testing.assert_close(model.used.bias.grad.cpu(), torch.full((2,), 3.0))


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_backward_inputs_and_autograd_grad_write_no_other_grad(backend):
    model = WithUnusedParameter().to(device())
    x = torch.randn(3, 4).to(device())
    fwd = torch.compile(lambda x: model(x).sum(), backend=backend)
    fwd(x).backward(inputs=[model.used.weight])
    assert model.used.bias.grad is None
    torch.testing.assert_close(model.used.weight.grad.cpu(), x.cpu().sum(0).expand(2, 4))
    (gb,) = torch.autograd.grad(fwd(x), [model.used.bias])
    assert model.used.bias.grad is None
    torch.testing.assert_close(gb.cpu(), torch.full((2,), 3.0))


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_a_grad_the_user_holds_is_the_one_updated(backend):
    # After zero_grad(set_to_none=False) the engine adds into the existing tensor; fused, the
    # zero-filled .grad is set aside during the pass and takes the gradient at its end.
    model = WithUnusedParameter().to(device())
    x = torch.randn(3, 4).to(device())
    fwd = torch.compile(lambda x: model(x).sum(), backend=backend)
    fwd(x).backward()
    held = model.used.weight.grad
    model.zero_grad(set_to_none=False)
    fwd(x).backward()
    assert model.used.weight.grad is held
    torch.testing.assert_close(held.cpu(), x.cpu().sum(0).expand(2, 4))
    # Not a zero fill (a second backward without zero_grad): added to, as always.
    fwd(x).backward()
    assert model.used.weight.grad is held
    torch.testing.assert_close(held.cpu(), 2 * x.cpu().sum(0).expand(2, 4))


def test_a_grad_filled_with_another_constant_is_added_to():
    model = WithUnusedParameter().to(device())
    x = torch.randn(3, 4).to(device())
    fwd = torch.compile(lambda x: model(x).sum(), backend=FUSED)
    fwd(x).backward()
    model.used.weight.grad.fill_(1.0)
    fwd(x).backward()
    torch.testing.assert_close(model.used.weight.grad.cpu(), 1.0 + x.cpu().sum(0).expand(2, 4))


class NormNet(nn.Module):
    """Conv (no bias: a bias before BatchNorm has a zero true gradient, which AdamW turns into noise), BatchNorm, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.max_pool2d(F.relu(self.norm(self.conv(x))), 2).flatten(1))


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "dampened": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.5),
}


def train_as_scripts_do(backend, dev, compiled_optimizer: bool, optimizer: str = "adamw", steps: int = STEPS):
    """Model and batches moved to the device and trained at once: no sync before the first step.

    Returns the model and, per step, (executions, UncachedCompile) after it.
    """
    torch.manual_seed(0)
    model = NormNet().to(dev)
    opt = OPTIMIZERS[optimizer](model.parameters())
    fwd = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend=backend) if backend else (
        lambda x, y: F.cross_entropy(model(x), y))
    step = torch.compile(opt.step, backend=backend) if backend and compiled_optimizer else opt.step
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 3, 16, 16, generator=g).to(dev), torch.randint(0, 4, (4,), generator=g).to(dev))
            for _ in range(steps)]
    after = []
    for x, y in data:
        opt.zero_grad(set_to_none=False)
        # Held through the step, as scripts hold it to log it: a pending output of the step
        # at the cut, whose place among the outputs (by tensor id) must not move at step 2.
        loss = fwd(x, y)
        loss.backward()
        step()
        if dev.type == "xla":
            xm.mark_step()
            after.append((executions(), counter("UncachedCompile")))
        loss.item()  # logged, as scripts do (after the cut: a transfer, no execution)
    return model, after


@pytest.mark.parametrize(
    "optimizer,compiled_optimizer",
    [("adamw", True), ("adamw", False), ("momentum", False), ("dampened", False), ("momentum", True), ("dampened", True)],
    ids=["compiled_adamw", "eager_adamw", "eager_sgd_momentum", "eager_sgd_dampened", "compiled_sgd_momentum",
         "compiled_sgd_dampened"],
)
def test_fused_step_batchnorm_and_fresh_optimizer_state_compile_once(optimizer, compiled_optimizer):
    # BatchNorm's num_batches_tracked enters the first step as a torch_xla constant (a 0-d 0
    # moved to the device). A compiled AdamW's buffers are created (zeros) when dynamo traces
    # it, an eager AdamW's by its own _init_group, called by the backend right before its first
    # step; an SGD gets zero momentum buffers (a compiled one while dynamo traces its first
    # step), which change no value with dampening 0.
    # All are materialized before the first step, which then compiles the program every
    # later step reuses. A dampened SGD's first step is another computation: left alone.
    fresh = counter(names.FRESH_STATE_COUNTER)
    ours, after = train_as_scripts_do(FUSED_STEP, device(), compiled_optimizer, optimizer)
    materialized = counter(names.FRESH_STATE_COUNTER) - fresh
    eager, _ = train_as_scripts_do(None, torch.device("cpu"), False, optimizer)
    for (name, a), b in zip(ours.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    executions_per_step = [b[0] - a[0] for a, b in zip(after, after[1:])]
    compiles = [b[1] - a[1] for a, b in zip(after, after[1:])]
    assert executions_per_step == [1] * (STEPS - 1)
    if optimizer == "dampened":
        assert materialized == 1  # the forward's counter only
        assert compiles == [1] + [0] * (STEPS - 2)
    else:
        assert materialized == 2  # the forward's counter, then the optimizer's buffers
        assert compiles == [0] * (STEPS - 1)


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_later_micro_batches_do_not_walk_the_pending_step(backend):
    # From the second micro-batch on, BatchNorm's statistics and every .grad hold the earlier
    # micro-batches' pending IR. Telling fresh state (constants) and zero fills from it must
    # not walk that IR: a walk creates a tensor per device-data leaf it finds, so the XLA
    # tensors a micro-batch creates would grow with the micro-batches before it.
    dev = device()
    torch.manual_seed(0)
    model = NormNet().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fwd = torch.compile(lambda x, y: F.cross_entropy(model(x), y) / 3, backend=backend)
    step = torch.compile(opt.step, backend=backend)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 16, 16, generator=g).to(dev), torch.randint(0, 4, (4,), generator=g).to(dev))
               for _ in range(3)]
    for _ in range(3):  # the last step is measured
        created = []
        opt.zero_grad(set_to_none=False)
        for x, y in batches:
            before = counter("CreateXlaTensor")
            loss = fwd(x, y)
            middle = counter("CreateXlaTensor")
            loss.backward()
            created.append((middle - before, counter("CreateXlaTensor") - middle))
        step()
        xm.mark_step()
    (fwd1, _), (fwd2, bwd2), (fwd3, bwd3) = created
    assert fwd2 == fwd3 == fwd1, created
    assert bwd3 == bwd2, created
