"""Autograd features behave as under upstream `openxla`, with backward + accumulation fused."""

import copy

import pytest
import torch
import torch.nn as nn
import torch_xla.core.xla_model as xm

from torch_xla_bridge import grad_sync
from xla_helpers import (
    FUSED,
    SYNC_COUNTER,
    UPSTREAM,
    GraphBreakMLP,
    SmallCNN,
    TinyTransformer,
    assert_grads_match,
    counter,
    cpu_and_xla_copy,
    cpu_state,
    device,
    executions,
    mlp,
    pending,
)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: nn.Module, b: nn.Module, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    ga, gb = grads_of(a), grads_of(b)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def both_backends(make, run, steps: int = 3):
    """Runs `run(model, compiled, step, backend)` on a fresh copy per backend (ours first).

    Returns the two models, trained.
    """
    torch.manual_seed(0)
    base = make()
    out = {}
    for backend in (FUSED, UPSTREAM):
        model = copy.deepcopy(base).to(device())
        compiled = torch.compile(model, backend=backend)
        for step in range(steps):
            run(model, compiled, step, backend)
        out[backend] = model
    return out[FUSED], out[UPSTREAM]


def test_graph_break_one_callback_one_execution():
    x = torch.randn(8, 16).to(device())
    calls_per_step, execs_per_step = [], []

    def run(model, compiled, step, backend):
        s0, e0 = counter(SYNC_COUNTER), executions()
        compiled(x).sum().backward()
        calls_per_step.append(counter(SYNC_COUNTER) - s0)
        execs_per_step.append(executions() - e0)
        if backend == FUSED:
            assert not any(pending([p.grad for p in model.parameters()]))

    fused, base = both_backends(GraphBreakMLP, run)
    ours = slice(0, 3)  # the first three records are ours
    assert calls_per_step[ours][1:] == [1, 1]  # counters are cleared while step 0 compiles
    # forward: three graphs, three executions; backward of all three + accumulation: one.
    assert execs_per_step[ours][1:] == [4, 4]
    assert_same_grads(fused, base)


def test_tied_weights_two_contributors():
    tokens = torch.randint(0, 32, (2, 8)).to(device())
    execs = []

    def run(model, compiled, step, backend):
        compiled(tokens).logsumexp(-1).mean()  # warm the shapes of this step
        e0 = executions()
        compiled(tokens).logsumexp(-1).mean().backward()
        execs.append(executions() - e0)

    fused, base = both_backends(TinyTransformer, run, steps=2)
    assert execs[1] == 2  # forward + (backward + both contributions to the tied .grad)
    assert not any(pending([p.grad for p in fused.parameters()]))
    # Two forwards and two backwards per step accumulate into the same .grad.
    assert_same_grads(fused, base, rtol=1e-5, atol=1e-6)


def test_frozen_parameters():
    x = torch.randn(8, 16).to(device())

    def make():
        m = mlp()
        m[0].requires_grad_(False)
        return m

    def run(model, compiled, step, backend):
        compiled(x).square().mean().backward()

    fused, base = both_backends(make, run)
    assert fused[0].weight.grad is None and fused[0].bias.grad is None
    assert not any(pending([p.grad for p in fused.parameters() if p.grad is not None]))
    assert_same_grads(fused, base)


def test_batchnorm_buffers_train_and_eval():
    x = torch.randn(4, 3, 16, 16).to(device())
    execs = []

    def run(model, compiled, step, backend):
        model.train()
        e0 = executions()
        compiled(x).sum().backward()
        execs.append(executions() - e0)

    fused, base = both_backends(lambda: SmallCNN(batch_norm=True), run)
    # Eager CPU, the reference for running_var, where upstream is wrong (biased variance).
    torch.manual_seed(0)
    eager = SmallCNN(batch_norm=True).train()
    for _ in range(3):
        eager(x.cpu()).sum().backward()
    assert execs[1:3] == [2, 2]  # forward (with the buffer update) + backward
    want, want_eager = cpu_state(base), cpu_state(eager)
    for name, value in cpu_state(fused).items():
        if not name.endswith("running_var"):
            torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(value, want_eager[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert_same_grads(fused, base)


def test_no_grad_inference_queues_no_callback():
    model = mlp().to(device())
    compiled = torch.compile(model, backend=FUSED)
    x = torch.randn(8, 16).to(device())
    compiled(x).sum().backward()  # compile the training graph first; counters reset while compiling
    with torch.no_grad():
        compiled(x).sum().item()
    syncs, e0 = counter(SYNC_COUNTER), executions()
    with torch.no_grad():
        for _ in range(3):
            out = compiled(x)
    out.cpu()
    assert counter(SYNC_COUNTER) == syncs
    assert executions() - e0 == 3
    assert grad_sync.live_backward_passes() == 0


def test_autograd_grad_writes_no_dot_grad():
    x = torch.randn(8, 16).to(device())
    results = {}

    def run(model, compiled, step, backend):
        loss = compiled(x).square().mean()
        results.setdefault(id(model), []).append(
            [g.cpu() for g in torch.autograd.grad(loss, list(model.parameters()))]
        )

    fused, base = both_backends(mlp, run)
    assert all(p.grad is None for p in fused.parameters())
    for got, want in zip(results[id(fused)], results[id(base)], strict=True):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_retain_graph_backward_twice():
    x = torch.randn(8, 16).to(device())

    def run(model, compiled, step, backend):
        model.zero_grad()
        loss = compiled(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()

    fused, base = both_backends(mlp, run)
    assert not any(pending([p.grad for p in fused.parameters()]))
    assert_same_grads(fused, base)
    # And twice one backward's gradient:
    single = copy.deepcopy(fused)
    single.zero_grad()
    torch.compile(single, backend=FUSED)(x).square().mean().backward()
    for name, g in grads_of(fused).items():
        torch.testing.assert_close(g, 2 * grads_of(single)[name], rtol=1e-6, atol=1e-7)


def test_tensor_hooks_and_post_accumulate_hooks():
    x = torch.randn(8, 16).to(device())
    seen = {}

    def run(model, compiled, step, backend):
        if step == 0:
            model[0].weight.register_hook(lambda g: g * 3.0)
            for name, p in model.named_parameters():
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name: seen.setdefault(id(model), {}).__setitem__(name, p.grad.norm().cpu())
                )
        model.zero_grad(set_to_none=False)
        compiled(x).square().mean().backward()

    fused, base = both_backends(mlp, run)
    assert_same_grads(fused, base)
    got, want = seen[id(fused)], seen[id(base)]
    assert got.keys() == want.keys() == dict(fused.named_parameters()).keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got[name], fused.get_parameter(name).grad.norm().cpu())


class ReplayDropout(nn.Module):
    """Eager CPU's dropout with a given mask: ``x * mask / (1 - p)``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.mask = None

    def forward(self, x):
        return x * self.mask / (1 - self.p)


def test_dropout_matches_eager_cpu():
    """Gradients as eager CPU's with the same mask (upstream scales by 1/p, twice in the backward)."""
    cpu_model, fused = cpu_and_xla_copy(
        lambda: nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5), nn.ReLU(), nn.Linear(64, 4))
    )
    cpu_model[1] = ReplayDropout(0.5)
    x = torch.randn(8, 16)

    def forward(m, x):
        # Returns the dropout's output too, so that its mask can be replayed on CPU.
        h = m[1](m[0](x))
        return m[3](m[2](h)), h

    compiled = torch.compile(forward, backend=FUSED)
    masks = []
    for _ in range(3):
        fused.zero_grad()
        cpu_model.zero_grad()
        out, h = compiled(fused, x.to(device()))
        out.square().mean().backward()
        cpu_model[1].mask = (h.detach().cpu() != 0).float()
        cpu_model(x).square().mean().backward()
        masks.append(cpu_model[1].mask)
        assert_same_grads(fused, cpu_model, rtol=1e-5, atol=1e-6)
    # The mask changes between steps (the seed is not frozen into a cached computation).
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_modes_eager_cpu_reference(set_to_none):
    cpu_model, model = cpu_and_xla_copy(mlp)
    compiled = torch.compile(model, backend=FUSED)
    xs = [torch.randn(8, 16) for _ in range(3)]
    for x in xs:
        model.zero_grad(set_to_none=set_to_none)
        cpu_model.zero_grad(set_to_none=set_to_none)
        compiled(x.to(device())).square().mean().backward()
        cpu_model(x).square().mean().backward()
    assert_grads_match(model, cpu_model)


def test_changing_batch_size_relowers_per_shape():
    """Automatic dynamic shapes: each new batch size gets its own lowering, a seen one is reused."""
    sizes = [8, 12, 16, 12]
    grads, execs, uncached = {}, {}, {}

    def run(model, compiled, step, backend):
        n = sizes[step]
        x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n)).to(device())
        model.zero_grad()
        e0, u0 = executions(), counter("UncachedCompile")
        compiled(x).square().mean().backward()
        execs.setdefault(backend, []).append(executions() - e0)
        uncached.setdefault(backend, []).append(counter("UncachedCompile") - u0)
        grads.setdefault(backend, []).append(model[0].weight.grad.cpu())
        if backend == FUSED:
            assert not any(pending([p.grad for p in model.parameters()]))

    both_backends(mlp, run, steps=len(sizes))
    assert execs[FUSED] == [2] * len(sizes)  # forward + (backward with accumulation)
    assert uncached[FUSED][-1] == 0  # batch 12 again: nothing compiles
    for got, want in zip(grads[FUSED], grads[UPSTREAM], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
