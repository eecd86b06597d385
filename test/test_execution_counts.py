"""Executions per training step: backward and accumulation are one XLA program."""

import pytest
import torch
import torch.nn.functional as F
import torch_xla.core.xla_model as xm

from xla_helpers import (
    FUSED,
    SYNC_COUNTER,
    UPSTREAM,
    counter,
    device,
    executions,
    mlp,
    mlp_task,
    pending,
    train,
)

STEPS = 5
WARMUP = 2  # step 1 compiles; set_to_none=False first sees an existing .grad in step 2


# (set_to_none, compiled optimizer) -> (ours, upstream) executions per steady-state step
EXPECTED = {
    (False, True): (3, 5),
    (True, True): (3, 4),
    (False, False): (3, 4),
    (True, False): (3, 4),
}


@pytest.mark.parametrize("set_to_none,compiled_optimizer", list(EXPECTED))
def test_executions_per_step(set_to_none, compiled_optimizer):
    ours, upstream = EXPECTED[(set_to_none, compiled_optimizer)]
    kw = dict(steps=STEPS, set_to_none=set_to_none, compiled_optimizer=compiled_optimizer)
    fused = train(mlp_task(), FUSED, **kw)
    base = train(mlp_task(), UPSTREAM, **kw)
    for rec in fused.steps[WARMUP:]:
        assert (rec.forward, rec.backward, rec.optimizer) == (1, 1, 1), rec
        assert rec.grads_pending == 0
    assert [r.total for r in base.steps[WARMUP:]] == [upstream] * (STEPS - WARMUP)
    assert [r.total for r in fused.steps[WARMUP:]] == [ours] * (STEPS - WARMUP)
    assert [r.loss for r in fused.steps] == pytest.approx([r.loss for r in base.steps], rel=1e-6)
    # Warm-up over: nothing compiles any more.
    assert len(set(fused.uncached_compiles[WARMUP:])) == 1


def test_grad_read_after_backward_executes_nothing():
    model = mlp().to(device())
    compiled = torch.compile(model, backend=FUSED)
    x, y = torch.randn(8, 16).to(device()), torch.randn(8, 4).to(device())
    for step in range(3):
        F.mse_loss(compiled(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        assert pending(grads) == [False] * len(grads), f"step {step}"
        before = executions()
        for g in grads:
            g.cpu()
        assert executions() == before, f"step {step}: reading .grad executed a program"


def test_input_requiring_grad_is_materialized():
    """An input created with requires_grad=True gets a materialized .grad too."""
    dev = device()
    # The data is drawn on the device: seed its RNG, so the draws do not depend on test order.
    xm.set_rng_state(1234, str(dev))
    weight = torch.randn(16, 4).to(dev)

    def f(data):
        return (data @ weight).tanh().sum()

    compiled = torch.compile(f, backend=FUSED)
    for step in range(3):
        data = torch.randn(8, 16, device=dev, requires_grad=True)
        compiled(data).backward()
        assert pending([data.grad]) == [False], f"step {step}"
        before = executions()
        got = data.grad.cpu()
        assert executions() == before
        cpu_data = data.detach().cpu().requires_grad_()
        (cpu_data @ weight.cpu()).tanh().sum().backward()
        torch.testing.assert_close(got, cpu_data.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("micro_batches", [4])
def test_gradient_accumulation_one_execution_per_backward(micro_batches):
    dev = device()
    model = mlp().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fwd = torch.compile(lambda x, y: F.mse_loss(model(x), y), backend=FUSED)
    data = [(torch.randn(8, 16).to(dev), torch.randn(8, 4).to(dev)) for _ in range(micro_batches)]
    uncached = []
    for step in range(4):
        opt.zero_grad(set_to_none=False)
        for x, y in data:
            loss = fwd(x, y) / micro_batches
            before = executions()
            loss.backward()
            assert executions() - before == 1, f"step {step}"
            assert not any(pending([p.grad for p in model.parameters()]))
        opt.step()
        xm.mark_step()
        uncached.append(counter("UncachedCompile"))
    assert uncached[1:] == [uncached[1]] * 3, uncached


def test_one_sync_per_backward_pass():
    model = mlp().to(device())
    compiled = torch.compile(model, backend=FUSED)
    x = torch.randn(8, 16).to(device())
    # Compiling clears torch_xla's counters (upstream's fallback-op scan), so count after it.
    compiled(x).sum().backward()
    before = counter(SYNC_COUNTER)
    for _ in range(3):
        compiled(x).sum().backward()
    assert counter(SYNC_COUNTER) - before == 3
