"""`openxla_fused_step`: forward, backward, accumulation and optimizer as one XLA execution per step."""

import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

from xla_helpers import (
    FUSED,
    FUSED_STEP,
    STEP_COUNTER,
    UPSTREAM,
    GraphBreakMLP,
    assert_grads_match,
    cnn_task,
    counter,
    cpu_and_xla_copy,
    cpu_state,
    device,
    executions,
    live_xla_tensors,
    make_model,
    messages_naming,
    mlp,
    mlp_task,
    pending,
    recorded_warnings,
    train,
    transformer_task,
)

STEPS = 5
WARMUP = 2  # step 1 compiles; step 2 first sees momentum buffers and an existing .grad


def assert_same_training(ours, theirs, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    assert [r.loss for r in ours.steps] == pytest.approx([r.loss for r in theirs.steps], rel=rtol, abs=atol)
    want = cpu_state(theirs.model)
    for name, value in cpu_state(ours.model).items():
        torch.testing.assert_close(value, want[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("compiled_optimizer", [True, False], ids=["compiled_opt", "eager_opt_mark_step"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_grads"])
def test_one_execution_per_step(set_to_none, compiled_optimizer):
    kw = dict(steps=STEPS, set_to_none=set_to_none, compiled_optimizer=compiled_optimizer)
    cuts = counter(STEP_COUNTER)
    ours = train(mlp_task(), FUSED_STEP, **kw)
    # Every optimizer step cuts the step: a compiled one in its graph, an eager one at its end.
    assert counter(STEP_COUNTER) - cuts == STEPS
    base = train(mlp_task(), UPSTREAM, **kw)
    for rec in ours.steps[WARMUP:]:
        # Forward and backward execute nothing; the step runs at the optimizer / mark_step.
        assert (rec.forward, rec.backward, rec.optimizer) == (0, 0, 1), rec
    assert [r.total for r in base.steps[WARMUP:]] == [5 if not set_to_none and compiled_optimizer else 4] * 3
    assert len(set(ours.uncached_compiles[WARMUP:])) == 1  # nothing compiles after warm-up
    assert_same_training(ours, base)


@pytest.mark.parametrize("make_task", [cnn_task, transformer_task], ids=["cnn", "transformer"])
@pytest.mark.parametrize("optimizer", ["momentum", "adamw"])
def test_matches_upstream_and_eager_cpu(make_task, optimizer):
    task = make_task()
    kw = dict(steps=6, optimizer=optimizer, set_to_none=False, compiled_optimizer=optimizer == "momentum")
    ours = train(task, FUSED_STEP, model=make_model(task), **kw)
    base = train(task, UPSTREAM, model=make_model(task), **kw)
    eager = train(task, None, model=make_model(task), on_xla=False, **kw)
    # One XLA program for the whole step rounds differently from three: not bit-equal.
    assert_same_training(ours, base, rtol=1e-5, atol=1e-6)
    assert_same_training(ours, eager, rtol=1e-5, atol=1e-6)
    assert [r.total for r in ours.steps[WARMUP:]] == [1] * (6 - WARMUP)


def test_gradient_accumulation_is_one_execution_per_step():
    torch.manual_seed(0)
    model = mlp().to(device())
    reference = copy.deepcopy(model)
    results = {}
    for backend, m in ((FUSED_STEP, model), (UPSTREAM, reference), (FUSED, copy.deepcopy(reference))):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        fwd = torch.compile(lambda x, y, m=m: F.mse_loss(m(x), y), backend=backend)
        step = torch.compile(opt.step, backend=backend)
        g = torch.Generator().manual_seed(0)
        counts = []
        for _ in range(4):
            e0 = executions()
            opt.zero_grad(set_to_none=False)
            for _ in range(4):
                x, y = torch.randn(8, 16, generator=g).to(device()), torch.randn(8, 4, generator=g).to(device())
                (fwd(x, y) / 4).backward()
            step()
            counts.append(executions() - e0)
        results[backend] = counts
    assert results[FUSED_STEP][WARMUP:] == [1, 1]
    assert results[FUSED][WARMUP:] == [9, 9]  # 4 forwards, 4 backwards, the optimizer
    assert results[UPSTREAM][WARMUP:] == [14, 14]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-6, atol=1e-7)


def test_graph_breaks_stay_one_execution_per_step():
    torch.manual_seed(0)
    cpu_model = GraphBreakMLP()
    models = {b: copy.deepcopy(cpu_model).to(device()) for b in (FUSED_STEP, UPSTREAM, FUSED)}
    x, y = torch.randn(8, 16).to(device()), torch.randn(8, 4).to(device())
    counts = {}
    for backend, model in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        compiled = torch.compile(model, backend=backend)
        counts[backend] = []
        for _ in range(4):
            e0 = executions()
            F.mse_loss(compiled(x), y).backward()
            opt.step()
            opt.zero_grad()
            xm.mark_step()
            counts[backend].append(executions() - e0)
    assert counts[FUSED_STEP][1:] == [1, 1, 1]
    assert counts[UPSTREAM][1:] == [8, 8, 8]  # 3 forward and 3 backward graphs, the seed sync, mark_step
    assert counts[FUSED][1:] == [5, 5, 5]  # 3 forward graphs, one backward for all, mark_step
    for p, q in zip(models[FUSED_STEP].parameters(), models[UPSTREAM].parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("read_at", ["before_backward", "after_backward"])
def test_loss_read_mid_step_degrades_once_and_stays_correct(read_at):
    torch.manual_seed(0)
    model = mlp().to(device())
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16).to(device()), torch.randn(8, 4).to(device())
    losses, counts = {}, {}
    for backend, m in ((FUSED_STEP, model), (UPSTREAM, reference)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        fwd = torch.compile(lambda x, y, m=m: F.mse_loss(m(x), y), backend=backend)
        losses[backend], counts[backend] = [], []
        with recorded_warnings() as caught:
            for _ in range(5):
                e0 = executions()
                loss = fwd(x, y)
                if read_at == "before_backward":
                    losses[backend].append(loss.item())
                loss.backward()
                if read_at == "after_backward":
                    losses[backend].append(loss.item())
                opt.step()
                opt.zero_grad()
                xm.mark_step()
                counts[backend].append(executions() - e0)
        if backend == FUSED_STEP:
            ours = messages_naming(caught, FUSED_STEP)
            assert len(ours) == 1, ours
            assert f"between its {'forward and backward' if read_at == 'before_backward' else 'backward and'}" in ours[0]
    # Step 1 reads the deferred forward (1 execution) and computes it again in the
    # step; then the forward executes on its own, so the read costs nothing.
    assert counts[FUSED_STEP] == [2] * 5
    assert counts[UPSTREAM][WARMUP:] == [4] * 3
    assert losses[FUSED_STEP] == pytest.approx(losses[UPSTREAM], rel=1e-6)


def test_eager_optimizer_without_sync_is_cut_at_the_next_forward():
    """No `mark_step`: one step's pending updates never grow into the next step's graph."""
    torch.manual_seed(0)
    model = mlp().to(device())
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    compiled = torch.compile(model, backend=FUSED_STEP)
    x, y = torch.randn(8, 16).to(device()), torch.randn(8, 4).to(device())
    counts, live = [], []
    for _ in range(30):
        e0 = executions()
        F.mse_loss(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()
        counts.append(executions() - e0)
        gc.collect()
        live.append(live_xla_tensors())
    assert counts[WARMUP:] == [1] * (30 - WARMUP)
    assert len(set(live[WARMUP:])) == 1
    xm.mark_step()

    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for _ in range(30):
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        xm.mark_step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.cpu(), q.cpu(), rtol=1e-5, atol=1e-6)


def test_no_grad_graph_ends_the_step_and_matches_upstream():
    torch.manual_seed(0)
    model = mlp().to(device())
    x = torch.randn(8, 16).to(device())
    want = torch.compile(model, backend=UPSTREAM)(x).cpu()
    compiled = torch.compile(model, backend=FUSED_STEP)
    with torch.no_grad():
        for _ in range(3):
            before = executions()
            out = compiled(x)
            assert executions() - before == 1
            assert not any(pending([out]))
    torch.testing.assert_close(out.cpu(), want)


class Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)

    def forward(self, x):
        return F.dropout(self.fc(x), p=0.5, training=True)


def test_dropout_is_fused_with_a_fresh_mask_every_step():
    ratios, masks = {}, []
    # None: eager on CPU, the reference (upstream openxla's factor here is 4.0, not 2.0).
    for backend in (FUSED_STEP, None):
        torch.manual_seed(0)
        dev = device() if backend else torch.device("cpu")
        model = Dropout().to(dev)
        compiled = torch.compile(model, backend=backend) if backend else model
        x = torch.randn(8, 16).to(dev)
        counts = []
        with recorded_warnings() as caught:
            for _ in range(4):
                model.zero_grad()
                e0 = executions()
                out = compiled(x)
                out.sum().backward()
                xm.mark_step()
                counts.append(executions() - e0)
                kept = (out != 0).sum(0).cpu().float()
                grad = model.fc.bias.grad.cpu()
                # The backward used the forward's mask: d(sum)/d(bias) is one factor times kept count.
                ratio = grad[kept > 0] / kept[kept > 0]
                assert torch.all(ratio == ratio[0]) and torch.all(grad[kept == 0] == 0)
                ratios.setdefault(backend, set()).add(ratio[0].item())
                if backend == FUSED_STEP:
                    masks.append(out != 0)
        if backend == FUSED_STEP:
            assert messages_naming(caught, FUSED_STEP) == []
            assert counts[1:] == [1, 1, 1]
    assert ratios[FUSED_STEP] == ratios[None] == {2.0}
    assert all(not torch.equal(a.cpu(), b.cpu()) for a, b in zip(masks, masks[1:]))  # not frozen


def _random_op(a: torch.Tensor) -> torch.Tensor:
    return torch.randn(5, 5, device=a.device) + a


@pytest.mark.parametrize("training", [True, False], ids=["dropout_training", "randn_inference"])
def test_seeding_random_ops_transfers_nothing_from_the_device(training):
    """As upstream's DynamRandomOpTest asserts of openxla: a graph is fed a fresh seed without reading anything back.

    That holds from the first call on, which lowers the graph and finds the
    parameter its random ops draw their seed from.
    """
    torch.manual_seed(0)
    if training:
        model = Dropout().to(device())
        compiled, x = torch.compile(model, backend=FUSED_STEP), torch.randn(8, 16).to(device())
    else:
        compiled, x = torch.compile(_random_op, backend=FUSED_STEP, fullgraph=True), torch.randn(5, 5).to(device())
    xm.mark_step()
    xm.wait_device_ops()
    met.clear_all()
    outs = []
    for _ in range(3):
        out = compiled(x)
        if training:
            out.sum().backward()
        xm.mark_step()
        outs.append(out)
    assert "TransferFromDeviceTime" not in met.metric_names()
    assert "TransferToDeviceTime" in met.metric_names()  # the fresh seeds
    assert all(not torch.equal(a.cpu(), b.cpu()) for a, b in zip(outs, outs[1:]))  # fresh numbers every call


def test_batchnorm_buffers_match_upstream_and_eager_cpu():
    task = cnn_task(batch_norm=True)
    kw = dict(steps=4, set_to_none=False, compiled_optimizer=False)
    ours = train(task, FUSED_STEP, model=make_model(task), **kw)
    base = train(task, UPSTREAM, model=make_model(task), **kw)
    eager = train(task, None, model=make_model(task), on_xla=False, **kw)
    assert [r.loss for r in ours.steps] == pytest.approx([r.loss for r in base.steps], rel=1e-5, abs=1e-6)
    want = cpu_state(base.model)
    for name, value in cpu_state(ours.model).items():
        if not name.endswith("running_var"):  # upstream's is biased; eager CPU's below is the reference
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert_same_training(ours, eager, rtol=1e-5, atol=1e-6)  # running_mean/var included in the state
    assert [r.total for r in ours.steps[WARMUP:]] == [1, 1]


def test_changing_batch_size_relowers_per_shape():
    """Automatic dynamic shapes: a new batch size is lowered once, a seen one compiles nothing."""
    torch.manual_seed(0)
    model = mlp().to(device())
    reference = copy.deepcopy(model)
    sizes = [8, 12, 16, 12]
    execs, uncached, grads = [], [], {}
    for backend, m in ((FUSED_STEP, model), (UPSTREAM, reference)):
        compiled = torch.compile(m, backend=backend)
        grads[backend] = []
        for n in sizes:
            x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n)).to(device())
            m.zero_grad()
            e0, u0 = executions(), counter("UncachedCompile")
            compiled(x).square().mean().backward()
            xm.mark_step()
            if backend == FUSED_STEP:
                execs.append(executions() - e0)
                uncached.append(counter("UncachedCompile") - u0)
            grads[backend].append(m[0].weight.grad.cpu())
    assert execs == [1] * len(sizes)
    assert uncached[-1] == 0  # batch 12 again
    for got, want in zip(grads[FUSED_STEP], grads[UPSTREAM], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_create_graph_is_correct():
    cpu_model, model = cpu_and_xla_copy(mlp)
    compiled = torch.compile(model, backend=FUSED_STEP)
    x = torch.randn(8, 16)
    with recorded_warnings() as caught:
        for _ in range(2):
            model.zero_grad()
            compiled(x.to(device())).square().mean().backward(create_graph=True)
            xm.mark_step()
    assert any("create_graph=True" in m for m in messages_naming(caught, FUSED_STEP))
    cpu_model(x).square().mean().backward(create_graph=True)
    assert_grads_match(model, cpu_model)


def test_resolves_without_import():
    from test_registration import run_python

    proc = run_python(
        """
        import sys
        import torch, torch_xla
        dev = torch_xla.device()
        model = torch.nn.Linear(4, 3).to(dev)
        compiled = torch.compile(model, backend="openxla_fused_step")
        out = compiled(torch.randn(2, 4).to(dev)).sum()
        out.backward()
        torch_xla.sync()
        print("loaded-by-entry-point", "torch_xla_bridge" in sys.modules, float(out))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "loaded-by-entry-point True" in proc.stdout


def test_optimizer_compiled_with_another_backend_degrades_once():
    """The step then runs in pieces; the forward is switched to executing on its own, once, correctly."""
    torch.manual_seed(0)
    model = mlp().to(device())
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16).to(device()), torch.randn(8, 4).to(device())
    losses, counts = {}, []
    for backend, m in ((FUSED_STEP, model), (UPSTREAM, reference)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        fwd = torch.compile(lambda x, y, m=m: F.mse_loss(m(x), y), backend=backend)
        step = torch.compile(opt.step, backend=UPSTREAM)
        losses[backend] = []
        with recorded_warnings() as caught:
            for _ in range(5):
                e0 = executions()
                loss = fwd(x, y)
                loss.backward()
                step()
                opt.zero_grad(set_to_none=False)
                losses[backend].append(loss.item())
                if backend == FUSED_STEP:
                    counts.append(executions() - e0)
        if backend == FUSED_STEP:
            ours = messages_naming(caught, FUSED_STEP)
            assert len(ours) == 1 and "executed by something other than" in ours[0], ours
    # Forward on its own, the optimizer's input sync (backward + accumulation), the optimizer.
    assert counts[WARMUP:] == [3, 3, 3]
    assert losses[FUSED_STEP] == pytest.approx(losses[UPSTREAM], rel=1e-6)


def test_compiled_adamw_is_one_execution_per_step():
    """A compiled AdamW's CPU step counts are read as data of the step's one execution (upstream: 7 executions)."""
    task = mlp_task()
    kw = dict(steps=5, optimizer="adamw", set_to_none=False, compiled_optimizer=True)
    ours = train(task, FUSED_STEP, model=make_model(task), **kw)
    base = train(task, UPSTREAM, model=make_model(task), **kw)
    grad = train(task, FUSED, model=make_model(task), **kw)
    assert_same_training(ours, base)
    assert_same_training(grad, base)
    assert [r.total for r in ours.steps[WARMUP:]] == [1] * 3
    # Forward, backward with the accumulation, the optimizer as one execution of its own.
    assert [r.total for r in grad.steps[WARMUP:]] == [3] * 3
    assert [r.total for r in base.steps[WARMUP:]] == [7] * 3


@pytest.mark.parametrize("marked_by", ["user", "graph"])
def test_donated_input_updated_in_place_compiles_once(marked_by):
    """An input marked for donation is donated at every call, as upstream's cached graph does: one compilation.

    (pytorch/xla's test_manual_buffer_donation_for_inplce_op_repeat: the first call's
    execution clears the mark, and a step keyed on it compiled a second time.)
    """
    def update(t: torch.Tensor) -> None:
        if marked_by == "graph":
            torch.ops.xla.dynamo_set_buffer_donor_(t, True)
        t += 0.3 * torch.cos(t)

    torch._dynamo.reset()
    x = torch.randn(5, 5)
    t = x.to(device())
    step = torch.compile(update, backend=FUSED_STEP)
    torch_xla.sync()
    if marked_by == "user":
        assert torch_xla._XLAC._set_buffer_donation(t, True)
    after_first = []
    for _ in range(6):
        step(t)
        x += 0.3 * torch.cos(x)
        after_first.append(counter("UncachedCompile"))
    assert len(set(after_first)) == 1, after_first  # the first call compiled (or found) the only graph
    assert not torch_xla._XLAC._get_buffer_donation(t)  # its buffer was donated; the new one is unmarked
    torch.testing.assert_close(t.cpu(), x)


def test_graph_outside_a_step_executes_its_pending_inputs_with_it():
    """An inference graph whose inputs are pending: one execution, which also leaves the inputs materialized.

    (Upstream syncs them first, in an execution of their own; pytorch/xla's test_simple_model.)
    """
    f = torch.compile(lambda a, b: a * b + b, backend=FUSED_STEP)
    x, y = torch.randn(3), torch.randn(3)
    xla_x, xla_y = x.to(device()), y.to(device())
    f(xla_x, xla_y)  # warm-up: compiles
    a, b = xla_x + xla_y, xla_y * 3  # pending
    before = executions()
    out = f(a, b)
    assert executions() - before == 1
    assert not any(pending([a, b, out]))
    torch.testing.assert_close(out.cpu(), (x + y) * (y * 3) + y * 3)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero_grads"])
def test_compiled_optimizer_updates_parameters_and_momentum_in_place(set_to_none):
    """The step's program donates each parameter's and momentum buffer's old buffer to its new value.

    As an eager optimizer's in-place updates are: the compiled step writes its
    new values into parameters and state as in-place updates before the cut
    (upstream writes them back after its own execution, keeping old and new).
    """
    # A width of its own: XLA's compilation cache is the process's, shared with the other tests.
    task = mlp_task(width=21 if set_to_none else 23)
    model = make_model(task)
    n_params = len(list(model.parameters()))
    before = met.metric_data("InputOutputAliasCount")
    seen = before[0] if before else 0
    compiles = counter("UncachedCompile")
    ours = train(task, FUSED_STEP, model=model, steps=STEPS, set_to_none=set_to_none, compiled_optimizer=True)
    assert [r.total for r in ours.steps[WARMUP:]] == [1] * (STEPS - WARMUP)
    # The fresh momentum buffers' materialization (no donor), then the step, compiled once.
    assert counter("UncachedCompile") - compiles == 2
    count, _, samples = met.metric_data("InputOutputAliasCount")
    donors = sorted(v for _, v in samples[-(count - seen):])
    assert donors == [0, 2 * n_params], donors
    assert_same_training(ours, train(task, UPSTREAM, model=make_model(task), steps=STEPS, set_to_none=set_to_none))


def test_graph_returning_its_updated_input_returns_the_new_value():
    """``a += 1; return a``: the update is written into the input, and the returned tensor is its new value."""
    torch._dynamo.reset()
    f = torch.compile(lambda a: a.add_(1), backend=FUSED_STEP, fullgraph=True)
    t = torch.tensor([0, 1, 2], device=device())
    for _ in range(4):
        t = f(t)
    torch.testing.assert_close(t.cpu(), torch.tensor([4, 5, 6]))
