"""``@torch_xla_bridge.replayed_step``: a whole training step traced twice, captured, then replayed.

Asserted: after warm-up each call is a replay (no retrace, one execution, nothing compiled), with the
numerics of the traced fused step bitwise and of eager CPU within 1e-6; each invalidation named in
torch_xla_bridge/replay.py either retraces (counted, one warning naming the cause) or keeps the step
traced on every call, never a wrong replay.
"""

from __future__ import annotations

import copy
import functools
import json
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm

import torch_xla_bridge
from torch_xla_bridge import counting, names

WIDTH, BATCH, STEPS = 32, 8, 8
# Eager CPU beside XLA: float rounding only.
CPU_ATOL = 1e-6


def model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Dropout(dropout), nn.Linear(WIDTH, 1))


def batches(n: int, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, WIDTH, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(n)]


def trainer(m: nn.Module, lr: float = 0.05, optimizer: Optional[Callable[..., torch.optim.Optimizer]] = None,
            set_to_none: bool = False) -> tuple[Callable[..., torch.Tensor], torch.optim.Optimizer]:
    """The loop as users write it: model compiled with the fused step, eager SGD with momentum (or
    ``optimizer(parameters)``)."""
    opt = optimizer(m.parameters()) if optimizer else torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
    fwd = torch.compile(m, backend=names.STEP_BACKEND_NAME)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=set_to_none)
        loss = F.mse_loss(fwd(x), y)
        loss.backward()
        opt.step()
        return loss

    return step, opt


def run(step: Callable[..., torch.Tensor], data: list, dev: Any) -> tuple[list[float], list[int]]:
    """Losses and executions per call."""
    losses, per_call = [], []
    for x, y in data:
        start = counting.executions()
        loss = step(x.to(dev), y.to(dev))
        xm.wait_device_ops()
        per_call.append(counting.executions() - start)
        losses.append(loss.item())
    return losses, per_call


def params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach().cpu() for p in m.parameters()]


@pytest.fixture
def dev() -> Any:
    torch._dynamo.reset()
    return torch_xla.device()


def test_replays_after_warm_up_bitwise_as_the_traced_step_and_as_eager_cpu(dev: Any) -> None:
    data = batches(STEPS)
    cpu = model()
    traced_model, replayed_model = copy.deepcopy(cpu).to(dev), copy.deepcopy(cpu).to(dev)
    traced_step, _ = trainer(traced_model)
    traced, _ = run(traced_step, data, dev)

    step, _ = trainer(replayed_model)
    replayed = torch_xla_bridge.replayed_step(step)
    replay_count = counting.counter(names.REPLAY_COUNTER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        losses, per_call = run(replayed, data[:4], dev)
        compiles = counting.counter(names.UNCACHED_COMPILE_COUNTER)
        more, more_calls = run(replayed, data[4:], dev)
    losses += more
    # Two traced calls, a third traced and captured (its step; the packed program run on the state before it,
    # for the check: two; the state it writes packed into flat buffers; the check: five executions), then
    # replays: one execution each, nothing compiled.
    assert (replayed.calls, replayed.captures, replayed.replays) == (STEPS, 1, STEPS - 3)
    assert replayed.packed
    assert counting.counter(names.REPLAY_COUNTER) - replay_count == STEPS - 3
    assert per_call[2:] + more_calls == [5] + [1] * (STEPS - 3), per_call + more_calls
    assert counting.counter(names.UNCACHED_COMPILE_COUNTER) == compiles
    assert losses == traced
    assert all(torch.equal(a, b) for a, b in zip(params(replayed_model), params(traced_model)))

    opt = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    for x, y in data:
        opt.zero_grad(set_to_none=False)
        F.mse_loss(cpu(x), y).backward()
        opt.step()
    assert max((a - b.detach()).abs().max().item() for a, b in zip(params(replayed_model), cpu.parameters())) \
        <= CPU_ATOL


def _warned(fn: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "replayed step" in str(w.message)]


def test_a_new_batch_shape_is_captured_again_and_named(dev: Any) -> None:
    m = model().to(dev)
    traced_model = copy.deepcopy(m)
    step, _ = trainer(m)
    replayed = torch_xla_bridge.replayed_step(step)
    data = batches(4) + batches(3, batch=2 * BATCH)
    messages = _warned(lambda: run(replayed, data, dev))
    # Calls 1-2 traced, 3 captured, 4 replayed; 5 (new shape) captured again, 6-7 replayed.
    assert (replayed.captures, replayed.replays) == (2, 3), (replayed.captures, replayed.replays)
    assert any("traced again: its arguments changed" in m for m in messages), messages
    traced_step, _ = trainer(traced_model)
    run(traced_step, data, dev)
    assert all(torch.equal(a, b) for a, b in zip(params(m), params(traced_model)))


def test_a_changed_learning_rate_is_traced_again_never_replayed_stale(dev: Any) -> None:
    m = model().to(dev)
    traced_model = copy.deepcopy(m)
    step, opt = trainer(m)
    replayed = torch_xla_bridge.replayed_step(step)
    data = batches(6)

    def with_decay(fn: Callable, o: torch.optim.Optimizer) -> None:
        for i, (x, y) in enumerate(data):
            if i == 4:
                o.param_groups[0]["lr"] = 0.01
            fn(x.to(dev), y.to(dev))

    messages = _warned(lambda: with_decay(replayed, opt))
    assert any("an optimizer's parameters or hyperparameters changed" in m for m in messages), messages
    assert replayed.captures == 2
    traced_step, traced_opt = trainer(traced_model)
    with_decay(traced_step, traced_opt)
    assert all(torch.equal(a, b) for a, b in zip(params(m), params(traced_model)))


def _scheduled(optimizer: str, lr: torch.Tensor) -> Callable[..., torch.optim.Optimizer]:
    if optimizer.startswith("adamw"):
        return lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1, capturable=True)
    return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9)


def _with_scheduler(step: Callable[..., torch.Tensor], opt: torch.optim.Optimizer, data: list, dev: Any,
                    inside: bool = False) -> tuple[list[float], list[int]]:
    """A LambdaLR stepped once per call: after the step (as users write it), or inside it."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))

    def scheduled(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = step(x, y)
        scheduler.step()
        return loss

    if inside:
        return run(torch_xla_bridge.replayed_step(scheduled), data, dev)
    losses, per_call = [], []
    for x, y in data:
        out = run(step, [(x, y)], dev)
        scheduler.step()
        losses += out[0]
        per_call += out[1]
    return losses, per_call


def _bound_step_trainer(m: nn.Module, optimizer: Callable[..., torch.optim.Optimizer], compiled: bool = False
                        ) -> tuple[Callable[..., torch.Tensor], torch.optim.Optimizer]:
    """As ``trainer``, but the optimizer's step is a bound method taken once, before any call (``compiled``:
    compiled with the fused step backend)."""
    opt = optimizer(m.parameters())
    fwd = torch.compile(m, backend=names.STEP_BACKEND_NAME)
    opt_step = torch.compile(opt.step, backend=names.STEP_BACKEND_NAME) if compiled else opt.step

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(fwd(x), y)
        loss.backward()
        opt_step()
        return loss

    return step, opt


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_bound_step", "adamw_compiled_step", "sgd"])
def test_a_scheduled_tensor_learning_rate_is_a_program_input_where_read_as_a_tensor(
        dev: Any, optimizer: str) -> None:
    """A tensor lr that a scheduler fills every call: AdamW(capturable=True) reads it as a tensor, so the
    replay transfers its new value (no retrace), however its step is called, eager or compiled (where the
    compiled step's host scalars are its transfer); SGD reads it as a number
    (.item()), so a new value retraces (bounded, warned), never replayed stale. All bitwise as the traced
    loop; AdamW within 1e-6 of eager CPU."""
    cpu = model()
    data = batches(STEPS)
    traced_model, replayed_model = copy.deepcopy(cpu).to(dev), copy.deepcopy(cpu).to(dev)
    make = (functools.partial(_bound_step_trainer, compiled=optimizer == "adamw_compiled_step")
            if optimizer in ("adamw_bound_step", "adamw_compiled_step") else trainer)
    traced_step, traced_opt = make(traced_model, optimizer=_scheduled(optimizer, torch.tensor(0.01)))
    traced, _ = _with_scheduler(traced_step, traced_opt, data, dev)

    step, opt = make(replayed_model, optimizer=_scheduled(optimizer, torch.tensor(0.01)))
    replayed = torch_xla_bridge.replayed_step(step)
    messages = _warned(lambda: _with_scheduler(replayed, opt, data, dev))
    if optimizer != "sgd":
        assert not messages and (replayed.captures, replayed.replays) == (1, STEPS - 3), messages
    else:
        # Each new lr a capture never replayed: after two in a row, traced on every call, named.
        assert any("traced again: an optimizer's parameters or hyperparameters changed" in m for m in messages)
        assert any("2 captures in a row were traced again before their first replay" in m for m in messages)
        assert replayed.replays == 0 and replayed.captures == 2, (replayed.replays, replayed.captures)
    # The schedule ran to its end on both (its values rounded to the tensor's float32).
    assert opt.param_groups[0]["lr"].item() == traced_opt.param_groups[0]["lr"].item() \
        == pytest.approx(0.01 / (1 + STEPS), rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(params(replayed_model), params(traced_model)))
    if optimizer != "sgd":
        cpu_opt = torch.optim.AdamW(cpu.parameters(), lr=0.01, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(cpu_opt, lambda s: 1 / (1 + s))
        for x, y in data:
            cpu_opt.zero_grad(set_to_none=False)
            F.mse_loss(cpu(x), y).backward()
            cpu_opt.step()
            scheduler.step()
        assert max((a - b.detach()).abs().max().item() for a, b in zip(params(replayed_model),
                                                                       cpu.parameters())) <= CPU_ATOL


@pytest.mark.parametrize("read", ["same", "float64"])
def test_a_tensor_learning_rate_read_outside_the_optimizer_step_is_never_replayed_stale(
        dev: Any, read: str) -> None:
    """The step also reads lr in a device op of its own, outside optimizer.step (unseen by the host tape).
    Read as it is, torch_xla gives it the device data the tape's transfer has (one input: replayed); read as
    another dtype, it is a number of the trace equal to a tape value, so a new lr retraces."""
    def make(m: nn.Module) -> tuple[Callable[..., torch.Tensor], torch.optim.Optimizer]:
        lr = torch.tensor(0.01)
        _, opt = trainer(m, optimizer=_scheduled("adamw", lr))
        fwd = torch.compile(m, backend=names.STEP_BACKEND_NAME)

        def with_lr_penalty(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            out = fwd(x)
            penalty = out * lr if read == "same" else (out.double() * lr.double()).float()
            loss = F.mse_loss(out, y) + penalty.mean()
            loss.backward()
            opt.step()
            return loss

        return with_lr_penalty, opt

    m = model().to(dev)
    traced_model = copy.deepcopy(m)
    data = batches(6)
    traced_step, traced_opt = make(traced_model)
    _with_scheduler(traced_step, traced_opt, data, dev)
    step, opt = make(m)
    replayed = torch_xla_bridge.replayed_step(step)
    messages = _warned(lambda: _with_scheduler(replayed, opt, data, dev))
    expected = (1, 3) if read == "same" else (2, 0)  # two captures never replayed, then traced
    assert (replayed.captures, replayed.replays) == expected, (replayed.captures, replayed.replays, messages)
    assert all(torch.equal(a, b) for a, b in zip(params(m), params(traced_model)))


@pytest.mark.parametrize("lr", ["float", "tensor"])
def test_a_scheduler_stepped_inside_the_step_keeps_it_traced(dev: Any, lr: str) -> None:
    """A replay would not run the scheduler: the step is traced on every call, named, and its lr follows the
    schedule exactly as the undecorated loop's."""
    m = model().to(dev)
    traced_model = copy.deepcopy(m)
    data = batches(5)

    def make(mm: nn.Module) -> tuple[Callable[..., torch.Tensor], torch.optim.Optimizer]:
        return trainer(mm, optimizer=_scheduled("adamw", torch.tensor(0.01) if lr == "tensor" else 0.01))

    traced_step, traced_opt = make(traced_model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(traced_opt, lambda s: 1 / (1 + s))
    for x, y in data:
        run(traced_step, [(x, y)], dev)
        scheduler.step()
    step, opt = make(m)
    messages = _warned(lambda: _with_scheduler(step, opt, data, dev, inside=True))
    assert messages and all("a scheduler stepped inside it" in msg for msg in messages), messages
    assert float(opt.param_groups[0]["lr"]) == float(traced_opt.param_groups[0]["lr"])
    assert all(torch.equal(a, b) for a, b in zip(params(m), params(traced_model)))


@pytest.mark.parametrize("case", ["dropout", "side_effect", "step_closure", "host_read"])
def test_what_cannot_be_replayed_is_traced_on_every_call_with_one_warning(dev: Any, case: str) -> None:
    def loop(decorate: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], Any, list[str]]:
        m = model(dropout=0.5 if case == "dropout" else 0.0).to(dev)
        torch.manual_seed(2)
        xm.set_rng_state(2)
        step, _ = trainer(m)
        kept: list[torch.Tensor] = []

        def with_side_effect(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = step(x, y)
            if case == "side_effect":
                kept.append(loss * 2)  # a pending tensor the step keeps outside it
            elif case == "step_closure":
                xm.add_step_closure(lambda: kept.append(torch.zeros(())))
            elif case == "host_read":
                kept.append(torch.tensor(loss.item()))  # a value read on the host inside the step
            return loss

        fn = torch_xla_bridge.replayed_step(with_side_effect) if decorate else with_side_effect
        messages = _warned(lambda: run(fn, batches(5), dev))
        torch_xla.sync()  # the last call's closure runs at the next cut
        return params(m), kept, fn, messages

    traced_params, traced_kept, _, _ = loop(decorate=False)
    got_params, kept, replayed, messages = loop(decorate=True)
    cause = {"dropout": "draws random numbers", "side_effect": "pending tensors that are neither state",
             "step_closure": "adds step closures", "host_read": "a value read on the host"}[case]
    assert [m for m in messages if "not replayed" in m] and all(cause in m for m in messages), messages
    assert replayed.replays == 0 and replayed.captures == 1, (replayed.replays, replayed.captures)
    # Exactly what the undecorated loop does: its side effects, its random numbers.
    assert len(kept) == len(traced_kept)
    if case == "host_read":  # the values read inside the step are the traced loop's, call by call
        assert [k.item() for k in kept] == [k.item() for k in traced_kept]
    assert all(torch.equal(a, b) for a, b in zip(got_params, traced_params))


def test_micro_batches_and_a_compiled_optimizer_replay_bitwise(dev: Any) -> None:
    # 3 micro-batches per step (folded into one loop by the fused step), the optimizer step compiled.
    micro, calls = 3, 6
    data = batches(micro * calls)

    def make(m: nn.Module) -> Callable[..., torch.Tensor]:
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        # The loss compiled with the model: the micro-batches fold into one loop.
        loss_of = torch.compile(lambda x, y: F.mse_loss(m(x), y) / micro, backend=names.STEP_BACKEND_NAME)
        opt_step = torch.compile(opt.step, backend=names.STEP_BACKEND_NAME)

        def step(*flat: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            for i in range(0, len(flat), 2):
                loss = loss_of(flat[i], flat[i + 1])
                loss.backward()
            opt_step()
            return loss

        return step

    def loop(step: Callable[..., torch.Tensor]) -> tuple[list[float], list[tuple[int, int]]]:
        """Losses, and executions and folds per call."""
        losses, per_call = [], []
        for c in range(calls):
            flat = [t.to(dev) for x, y in data[c * micro:(c + 1) * micro] for t in (x, y)]
            start, folds = counting.executions(), counting.counter(names.FOLD_COUNTER)
            losses.append(step(*flat).item())
            per_call.append((counting.executions() - start, counting.counter(names.FOLD_COUNTER) - folds))
        return losses, per_call

    m = model().to(dev)
    traced_model = copy.deepcopy(m)
    traced, _ = loop(make(traced_model))
    replayed = torch_xla_bridge.replayed_step(make(m))
    losses, per_call = loop(replayed)
    assert (replayed.captures, replayed.replays) == (1, calls - 3)
    # Traced calls fold their micro-batches into one loop; a replay runs that loop's program: one execution.
    assert per_call[1][1] == micro - 1 and per_call[3:] == [(1, 0)] * (calls - 3), per_call
    assert losses == traced
    assert all(torch.equal(a, b) for a, b in zip(params(m), params(traced_model)))


def _intervene(case: str, m: nn.Module, opt: torch.optim.Optimizer, fwd_eval: Callable, dev: Any) -> Any:
    """A change made between two calls, as a user's loop makes it; returns what it computed, if anything."""
    if case == "grad_set_to_none":
        opt.zero_grad(set_to_none=True)
    elif case == "optimizer_state_cleared":
        opt.state.clear()
    elif case == "parameter_replaced":
        m[0].bias = nn.Parameter(torch.full((WIDTH,), 0.5, device=dev))
    elif case == "requires_grad_toggled":
        m[3].bias.requires_grad_(False)
    elif case == "left_in_eval_mode":
        m.eval()
    elif case == "model_state_loaded":
        m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()})
    elif case == "evaluated":
        m.eval()
        with torch.no_grad():
            out = fwd_eval(torch.ones(BATCH, WIDTH, device=dev)).cpu()
        m.train()
        return out
    elif case == "parameters_read":
        return [p.detach().cpu() for p in m.parameters()] + [g.cpu() for g in
                                                             (p.grad for p in m.parameters())]
    return None


# Each change: whether the step is traced again after it (and the cause the warning names), or replays on.
CHANGES = {
    "grad_set_to_none": "a parameter's .grad was set to None",
    "optimizer_state_cleared": "an optimizer's state was replaced",
    "parameter_replaced": "a parameter, buffer or submodule of the model was registered",
    "requires_grad_toggled": "its requires_grad toggled",
    "left_in_eval_mode": "training flag changed",
    "model_state_loaded": None,
    "evaluated": None,
    "parameters_read": None,
}


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_a_change_between_calls_is_seen_as_the_traced_loop_sees_it(dev: Any, case: str) -> None:
    """Replays read the state as it is (written through its views); what a replay cannot honour retraces, named."""
    calls, at = 7, 4  # calls 1-2 traced, 3 captured, 4 replayed, then the change, then calls 5-7

    def loop(decorate: bool) -> tuple[list[float], list[torch.Tensor], Any, Any, list[str]]:
        m = model().to(dev)
        step, opt = trainer(m)
        fwd_eval = torch.compile(m, backend=names.STEP_BACKEND_NAME)
        fn = torch_xla_bridge.replayed_step(step) if decorate else step
        losses, seen = [], None

        def go() -> None:
            nonlocal seen
            for i, (x, y) in enumerate(batches(calls)):
                if i == at:
                    seen = _intervene(case, m, opt, fwd_eval, dev)
                losses.append(fn(x.to(dev), y.to(dev)).item())

        messages = _warned(go)
        return losses, params(m), seen, fn, messages

    traced_losses, traced_params, traced_seen, _, _ = loop(decorate=False)
    losses, got_params, seen, replayed, messages = loop(decorate=True)
    cause = CHANGES[case]
    if cause is None:
        assert not messages, messages
        assert (replayed.captures, replayed.replays) == (1, calls - 3)
    else:
        assert any("traced again: " in msg and cause in msg for msg in messages), messages
        assert replayed.replays >= 1 and replayed.captures == 2, (replayed.replays, replayed.captures)
    assert losses == traced_losses
    assert all(torch.equal(a, b) for a, b in zip(got_params, traced_params))
    if traced_seen is not None:
        assert all(torch.equal(a, b) for a, b in zip(seen if isinstance(seen, list) else [seen],
                                                     traced_seen if isinstance(traced_seen, list) else [traced_seen]))


def test_set_to_none_steps_replay_bitwise(dev: Any) -> None:
    def make(m: nn.Module) -> Callable[..., torch.Tensor]:
        return trainer(m, set_to_none=True)[0]

    m = model().to(dev)
    traced_model = copy.deepcopy(m)
    data = batches(6)
    traced, _ = run(make(traced_model), data, dev)
    replayed = torch_xla_bridge.replayed_step(make(m))
    losses, per_call = run(replayed, data, dev)
    assert (replayed.captures, replayed.replays) == (1, 3) and per_call[3:] == [1, 1, 1], per_call
    assert losses == traced
    assert all(torch.equal(a, b) for a, b in zip(params(m), params(traced_model)))
    assert all(torch.equal(p.grad.cpu(), q.grad.cpu()) for p, q in zip(m.parameters(), traced_model.parameters()))


@pytest.mark.parametrize("capturable", [False, True])
def test_adamw_replays_with_its_step_count_on_the_device_and_is_traced_with_it_on_the_host(
        dev: Any, capturable: bool) -> None:
    """AdamW's step count is a CPU tensor unless capturable=True: its bias corrections are then constants of
    the trace, which a replay would keep stale; so that step is traced on every call, and named."""
    def make(m: nn.Module) -> Callable[..., torch.Tensor]:
        return trainer(m, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.01, capturable=capturable))[0]

    data = batches(6)
    m = model().to(dev)
    traced_model = copy.deepcopy(m)
    traced, _ = run(make(traced_model), data, dev)
    replayed = torch_xla_bridge.replayed_step(make(m))
    messages = _warned(lambda: run(replayed, data, dev))
    if capturable:
        assert not messages and (replayed.captures, replayed.replays) == (1, 3), (messages, replayed.replays)
    else:
        assert replayed.replays == 0 and messages and all("optimizer state kept on the host" in m
                                                          for m in messages), messages
    assert all(torch.equal(a, b) for a, b in zip(params(m), params(traced_model)))


def test_explain_reports_replays_captures_and_why_a_step_was_traced_again(dev: Any) -> None:
    from torch_xla_bridge import explain

    m = model().to(dev)
    step, opt = trainer(m)
    replayed = torch_xla_bridge.replayed_step(step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with explain.explain() as ex:
            for i, (x, y) in enumerate(batches(7)):
                if i == 5:
                    opt.param_groups[0]["lr"] = 0.01
                replayed(x.to(dev), y.to(dev))
    steps = ex.report.steps
    assert [s.replays for s in steps] == [0, 0, 0, 1, 1, 0, 1], [s.replays for s in steps]
    # A capture: the check's run of the packed program on the state before (two), the step, the check's
    # comparison, the packing; a retrace unpacks first.
    assert [s.total for s in steps[2:]] == [5, 1, 1, 6, 1], [s.total for s in steps]
    capture, replay, retrace = steps[2], steps[3], steps[5]
    details = [x.detail for x in capture.executions]
    assert "capture" in details[0] and "cuts the step" in details[2] and "packed" in details[4], details
    assert all("compared with the call's values" in details[i] for i in (0, 1, 3)), details
    assert replay.executions[0].detail.startswith("replayed step: the captured step's program")
    assert "unpacked" in retrace.executions[0].detail
    assert any("traced again: an optimizer's parameters or hyperparameters changed" in x.detail
               for x in retrace.executions), [x.detail for x in retrace.executions]


def test_a_hugging_face_gpt2_with_tied_weights_replays_bitwise(dev: Any) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def make() -> tuple[nn.Module, Callable[..., torch.Tensor]]:
        torch.manual_seed(0)
        m = transformers.GPT2LMHeadModel(config).to(dev)
        m.tie_weights()  # tied on the device too: one parameter read by the embedding and the head
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        loss_of = torch.compile(lambda ids: m(input_ids=ids, labels=ids).loss, backend=names.STEP_BACKEND_NAME)

        def step(ids: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            loss = loss_of(ids)
            loss.backward()
            opt.step()
            return loss

        return m, step

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(6)]
    traced_model, traced_step = make()
    m, step = make()
    assert m.transformer.wte.weight is m.lm_head.weight
    replayed = torch_xla_bridge.replayed_step(step)
    traced = [traced_step(ids.to(dev)).item() for ids in data]
    losses, per_call = [], []
    for ids in data:
        start = counting.executions()
        losses.append(replayed(ids.to(dev)).item())
        per_call.append(counting.executions() - start)
    assert (replayed.captures, replayed.replays) == (1, 3) and per_call[3:] == [1, 1, 1], per_call
    assert losses == traced
    assert all(torch.equal(a, b) for a, b in zip(params(m), params(traced_model)))


def test_a_sharded_step_replays_with_its_shardings_bitwise(tmp_path: Any) -> None:
    """SPMD on 4 devices (its own process, test/spmd_replay_checks.py): FSDP-style sharded parameters, batches
    sharded over rows; and FSDPv2 compiled whole. Replayed after warm-up, one execution per call, nothing compiled; bitwise as the loop
    traced on every call, parameters and .grad keep their shardings, within 1e-6 of eager CPU; a batch that
    comes in with another sharding is captured again and named."""
    from test_spmd import ROOT, _run_spmd

    out = tmp_path / "result.json"
    _run_spmd(ROOT / "test" / "spmd_replay_checks.py", str(out))
    result = json.loads(out.read_text())
    traced, replayed = result["traced"], result["replayed"]
    assert result["devices"] == 4
    # Calls 1-2 traced, 3 captured (no packing under SPMD: one execution), 4-6 replayed; 7's batch is
    # replicated (captured again), 8's sharded again (captured again), 9 replayed.
    assert (replayed["captures"], replayed["replays"]) == (3, 4), replayed
    assert replayed["per_call"] == traced["per_call"] == [2] + [1] * 8, (replayed["per_call"], traced["per_call"])
    assert replayed["compiles"][3:6] == [replayed["compiles"][2]] * 3 and replayed["compiles"][8] == \
        replayed["compiles"][7], replayed["compiles"]
    assert replayed["warnings"] and all("its arguments changed" in m and "sharding" in m
                                        for m in replayed["warnings"]), replayed["warnings"]
    assert replayed["losses"] == traced["losses"]
    assert replayed["params"] == traced["params"]
    assert replayed["param_specs"] == traced["param_specs"] and replayed["grad_specs"] == traced["grad_specs"]
    assert all("devices=" in s for s in replayed["param_specs"]), replayed["param_specs"]
    assert max((torch.tensor(a) - torch.tensor(b)).abs().max().item()
               for a, b in zip(replayed["params"], result["eager_cpu"])) <= CPU_ATOL
    # FSDPv2 compiled whole, AdamW(capturable=True) with a scheduled tensor lr: replayed from call 4 on (each
    # new lr an input), bitwise, shardings kept.
    fsdp_traced, fsdp_replayed = result["fsdpv2_traced"], result["fsdpv2_replayed"]
    assert fsdp_replayed["replays"] == 3 and fsdp_replayed["per_call"] == fsdp_traced["per_call"] == [2] + [1] * 5
    assert fsdp_replayed["losses"] == fsdp_traced["losses"] and fsdp_replayed["params"] == fsdp_traced["params"]
    assert fsdp_replayed["param_specs"] == fsdp_traced["param_specs"]


def test_a_replay_whose_execution_fails_changes_nothing_and_training_goes_on(dev: Any, monkeypatch: Any) -> None:
    """The replay's execution raises (as XLA's RESOURCE_EXHAUSTED would): the error reaches the caller as it
    is, parameters, .grad and optimizer state are as before the call, and the next calls replay on; the run
    ends bitwise where the traced loop that skipped that batch does."""
    data = batches(7)
    failing = 4  # the fifth call: a replay
    m = model().to(dev)
    traced_model = copy.deepcopy(m)
    traced_step, _ = trainer(traced_model)
    run(traced_step, data[:failing] + data[failing + 1:], dev)

    step, opt = trainer(m)
    replayed = torch_xla_bridge.replayed_step(step)
    run(replayed, data[:failing], dev)
    before = [t.detach().cpu() for t in (*m.parameters(), *(p.grad for p in m.parameters()),
                                          *(opt.state[p]["momentum_buffer"] for p in m.parameters()))]
    real = torch_xla_bridge._private.run_cached_graph

    def exhausted(graph_hash: bytes, inputs: list) -> list:
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")

    monkeypatch.setattr(torch_xla_bridge._private, "run_cached_graph", exhausted)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        replayed(*(t.to(dev) for t in data[failing]))
    monkeypatch.setattr(torch_xla_bridge._private, "run_cached_graph", real)
    after = [t.detach().cpu() for t in (*m.parameters(), *(p.grad for p in m.parameters()),
                                         *(opt.state[p]["momentum_buffer"] for p in m.parameters()))]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    replays = replayed.replays
    _, per_call = run(replayed, data[failing + 1:], dev)
    assert replayed.replays == replays + 2 and per_call == [1, 1], (replayed.replays, per_call)
    assert all(torch.equal(a, b) for a, b in zip(params(m), params(traced_model)))


def test_a_packed_program_that_differs_from_the_traced_call_is_replaced_by_the_traced_program(dev: Any) -> None:
    """A small CNN (convolutions, BatchNorm, clip_grad_norm_, weight decay): XLA compiles the traced program
    embedded in the packed one otherwise than alone, and the capture's check (the packed program run on the state
    before the call, compared with the call's values) finds it 1e-7 apart. The next call captures the traced
    program itself, unpacked, and the replays are bitwise the traced loop's."""
    def make(m: nn.Module) -> Callable[..., torch.Tensor]:
        opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        fwd = torch.compile(m, backend=names.STEP_BACKEND_NAME)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(fwd(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            return loss

        return step

    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                        nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).to(dev)
    traced_cnn = copy.deepcopy(cnn)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(6)]
    traced, _ = run(make(traced_cnn), data, dev)
    replayed = torch_xla_bridge.replayed_step(make(cnn))
    losses, per_call = run(replayed, data, dev)
    # Call 3 captured and checked (no packing: it differs), call 4 captured unpacked, calls 5-6 replayed.
    assert not replayed.packed and (replayed.captures, replayed.replays) == (2, 2), (replayed.captures,
                                                                                   replayed.replays)
    assert per_call[4:] == [1, 1], per_call
    assert losses == traced
    assert all(torch.equal(a, b) for a, b in zip(
        [t.detach().cpu() for t in (*cnn.parameters(), *cnn.buffers())],
        [t.detach().cpu() for t in (*traced_cnn.parameters(), *traced_cnn.buffers())]))
