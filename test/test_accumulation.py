"""Gradient accumulation under openxla_fused_step: K micro-batches folded into one loop.

Asserted for the loop as users write it (``loss = f(x, y) / K; loss.backward()``
per micro-batch, then ``opt.step(); opt.zero_grad()``): one execution per
step and no compile after warm-up at K = 1, 3, 8; losses, gradients and
parameters as eager CPU's, and exactly (bitwise) as the same step unrolled;
the step's program holds one forward and one backward whatever K (its HLO
counted); each micro-batch's loss read after the step at no execution;
BatchNorm's running statistics carried by the loop; and the degraded cases (a
smaller last micro-batch, a loss computed eagerly outside the compiled graph, a
read inside the loop) correct, with the warning that names why where one is due.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import re
import types
import warnings
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.debug.metrics as met

from torch_xla_bridge import accumulation
from xla_helpers import FUSED_STEP, counter, executions, names

NOT_FOLDED = "gradient accumulation is not folded into one loop"
GRAPH_CALL = re.compile(r"to_apply=%FusedGradGraph")


def _model(batch_norm: bool = False, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 32)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(32))
    layers += [nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 4)]
    return nn.Sequential(*layers)


def _batches(k: int, batch: int = 8, last: Optional[int] = None, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    sizes = [batch] * k if last is None else [batch] * (k - 1) + [last]
    return [(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in sizes]


class _Run:
    """One training run: per step, the micro-batches' losses (tensors, read after the step) and what it cost."""

    def __init__(self, model: nn.Module, compiled_optimizer: bool = False, eager_loss: bool = False) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if eager_loss:
            forward = torch.compile(model, backend=FUSED_STEP)
            self.loss_of = lambda x, y, k: F.cross_entropy(forward(x), y) / k
        else:
            compiled = torch.compile(lambda x, y, k: F.cross_entropy(model(x), y) / k, backend=FUSED_STEP)
            self.loss_of = compiled
        self.opt_step = torch.compile(self.opt.step, backend=FUSED_STEP) if compiled_optimizer else self.opt.step
        self.executions: list[int] = []
        self.compiles: list[int] = []

    def step(self, batches: list[tuple[torch.Tensor, ...]], inside: Optional[Callable[[], None]] = None
             ) -> list[torch.Tensor]:
        dev = torch_xla.device()
        e0, c0 = executions(), counter("UncachedCompile")
        losses = []
        for x, y in batches:
            loss = self.loss_of(x.to(dev), y.to(dev), len(batches))
            loss.backward()
            losses.append(loss)
            if inside is not None:
                inside()
        self.opt_step()
        self.opt.zero_grad()
        self.executions.append(executions() - e0)
        self.compiles.append(counter("UncachedCompile") - c0)
        return losses


def _eager_cpu(model: nn.Module, steps: list[list[tuple[torch.Tensor, ...]]]) -> tuple[list[list[float]], nn.Module]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batches in steps:
        step = []
        for x, y in batches:
            loss = F.cross_entropy(model(x), y) / len(batches)
            loss.backward()
            step.append(loss.item())
        opt.step()
        opt.zero_grad()
        losses.append(step)
    return losses, model


def _eager_cpu_grad_norms(model: nn.Module, steps: list[list[tuple[torch.Tensor, ...]]]) -> list[float]:
    """The first layer's ``.grad`` norm after each micro-batch, training ``model`` on the CPU as ``_Run`` does."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for batches in steps:
        for x, y in batches:
            (F.cross_entropy(model(x), y) / len(batches)).backward()
            norms.append(model[0].weight.grad.norm().item())
        opt.step()
        opt.zero_grad()
    return norms


def _assert_trains_like_eager_cpu(run: _Run, cpu: nn.Module, data: list[list[tuple[torch.Tensor, ...]]],
                                   losses: list[list[float]], atol: float = 1e-6) -> None:
    """Losses, parameters and buffers of ``run`` against eager CPU's on the same steps (``cpu`` trains here)."""
    want, ref = _eager_cpu(cpu, data)
    for g, w in zip(losses, want):
        assert g == pytest.approx(w, abs=atol)
    for p, q in zip(run.model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=0, atol=atol)
    for b, c in zip(run.model.buffers(), ref.buffers()):
        torch.testing.assert_close(b.cpu(), c, rtol=0, atol=atol)


def _train(k: int, steps: int = 3, **kw) -> tuple[_Run, list[list[torch.Tensor]]]:
    cpu = _model(**{a: kw.pop(a) for a in ("batch_norm", "dropout") if a in kw})
    run = _Run(copy.deepcopy(cpu).to(torch_xla.device()), **kw)
    data = [_batches(k, seed=s) for s in range(steps)]
    return run, [run.step(b) for b in data]


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("compiled_optimizer", [False, True], ids=["eager_opt", "compiled_opt"])
def test_one_execution_per_step_and_eager_cpu_numerics(k: int, compiled_optimizer: bool) -> None:
    cpu = _model()
    run = _Run(copy.deepcopy(cpu).to(torch_xla.device()), compiled_optimizer=compiled_optimizer)
    data = [_batches(k, seed=s) for s in range(4)]
    folds0 = counter(names.FOLD_COUNTER)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing degrades
        losses = [run.step(b) for b in data]
    e_read = executions()
    got = [[t.item() for t in step] for step in losses]
    assert executions() == e_read, "reading the micro-batches' losses after the step executed something"
    assert run.executions[2:] == [1, 1], run.executions
    assert run.compiles[2:] == [0, 0], run.compiles
    assert counter(names.FOLD_COUNTER) - folds0 == 4 * (k - 1)
    _assert_trains_like_eager_cpu(run, cpu, data, got)


def _unfolded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same step with nothing folded: every micro-batch unrolled into the program, as before folding."""
    monkeypatch.setattr(accumulation.Accumulation, "end_of_backward", lambda self: None)


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["plain", "dropout"])
def test_bitwise_the_unrolled_step(monkeypatch: pytest.MonkeyPatch, dropout: float) -> None:
    """Same gradients, losses and parameters, bit for bit, as the same K=4 step unrolled (dropout: the same
    random numbers per micro-batch)."""
    results = []
    for fold in (True, False):
        if not fold:
            _unfolded(monkeypatch)
        torch._dynamo.reset()
        torch_xla.manual_seed(0)
        run, losses = _train(4, steps=2, dropout=dropout)
        results.append(([[t.cpu() for t in s] for s in losses], [p.cpu() for p in run.model.parameters()]))
    (folded_losses, folded), (unrolled_losses, unrolled) = results
    for a, b in zip(folded_losses, unrolled_losses):
        assert torch.equal(torch.stack(a), torch.stack(b))
    for a, b in zip(folded, unrolled):
        assert torch.equal(a, b)


def _step_hlo(k: int, last: Optional[int] = None, **kw) -> str:
    """The HLO of a warm step's gradients, just before the optimizer step (after 1 step of warm-up)."""
    cpu = _model(**kw)
    run = _Run(copy.deepcopy(cpu).to(torch_xla.device()))
    run.step(_batches(k, last=last))
    dev = torch_xla.device()
    for x, y in _batches(k, last=last, seed=2):
        run.loss_of(x.to(dev), y.to(dev), k).backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([p.grad for p in run.model.parameters()])
    torch_xla.sync()
    run.opt.zero_grad()
    return hlo


def test_program_holds_one_micro_batch_whatever_k() -> None:
    """The step's program calls the forward and the backward graph once each, inside one loop, at K=3 and
    K=8 (unrolled: 2K calls); its size does not grow with K beyond stacking the K inputs."""
    hlo = {k: _step_hlo(k) for k in (3, 8)}
    for k, text in hlo.items():
        assert len(GRAPH_CALL.findall(text)) == 2, k
        assert text.count(" while(") == 1, k
    lines = {k: len(text.splitlines()) for k, text in hlo.items()}
    # Per micro-batch more: its inputs (a parameter and a reshape each) and its loss's tangent (a
    # constant, a broadcast, a reshape) stacked, never its graphs (hundreds of lines unrolled).
    assert lines[8] - lines[3] <= 10 * (8 - 3), lines


def test_smaller_last_micro_batch_is_a_group_of_its_own() -> None:
    """7 micro-batches of 8 rows and a last of 5: one loop over the 7, the last unrolled; numerics as eager CPU."""
    text = _step_hlo(8, last=5)
    assert text.count(" while(") == 1
    assert len(GRAPH_CALL.findall(text)) == 4  # the loop's forward and backward, the last micro-batch's
    cpu = _model()
    run = _Run(copy.deepcopy(cpu).to(torch_xla.device()))
    data = [_batches(8, last=5, seed=s) for s in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        losses = [[t.item() for t in run.step(b)] for b in data]
    assert run.executions[1:] == [1, 1]
    _assert_trains_like_eager_cpu(run, cpu, data, losses)


def test_batch_norm_statistics_are_carried_by_the_loop() -> None:
    """BatchNorm's running statistics, which each micro-batch's forward updates in place, are the loop's carried
    state: folded, and statistics, losses and parameters as eager CPU's."""
    cpu = _model(batch_norm=True)
    run = _Run(copy.deepcopy(cpu).to(torch_xla.device()))
    data = [_batches(4, seed=s) for s in range(3)]
    folds0 = counter(names.FOLD_COUNTER)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        losses = [[t.item() for t in run.step(b)] for b in data]
    assert counter(names.FOLD_COUNTER) - folds0 == 3 * (4 - 1)
    assert run.executions[1:] == [1, 1]
    _assert_trains_like_eager_cpu(run, cpu, data, losses, atol=1e-5)


def test_an_eagerly_computed_loss_stays_unrolled_and_says_why() -> None:
    """A loss computed eagerly from the compiled model's output feeds each backward from its own forward:
    unrolled, correct, one warning naming the fix."""
    cpu = _model()
    run = _Run(copy.deepcopy(cpu).to(torch_xla.device()), eager_loss=True)
    data = [_batches(3, seed=s) for s in range(3)]
    folds0 = counter(names.FOLD_COUNTER)
    accumulation._warn_once.cache_clear()  # said once per process: an earlier test may have said it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [[t.item() for t in run.step(b)] for b in data]
    said = [str(w.message) for w in caught if NOT_FOLDED in str(w.message)]
    assert len(said) == 1 and "compile the loss with the model" in said[0], said
    assert counter(names.FOLD_COUNTER) == folds0
    assert run.executions[1:] == [1, 1]
    _assert_trains_like_eager_cpu(run, cpu, data, losses, atol=1e-5)


def test_a_read_inside_the_loop_starts_a_new_group() -> None:
    """A gradient norm read after each micro-batch executes what it reads; the step stays correct and the
    micro-batches after a read fold from the values it left."""
    cpu = _model()
    run = _Run(copy.deepcopy(cpu).to(torch_xla.device()))
    model = run.model
    norms: list[float] = []
    data = [_batches(3, seed=s) for s in range(2)]
    with pytest.warns(UserWarning, match="forward executes on its own"):  # the read, as without folding
        for batches in data:
            run.step(batches, inside=lambda: norms.append(model[0].weight.grad.norm().item()))
    assert norms == pytest.approx(_eager_cpu_grad_norms(cpu, data), rel=1e-5)
    for p, q in zip(model.parameters(), cpu.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=0, atol=1e-6)


def test_explain_says_whether_the_micro_batches_were_folded() -> None:
    """The explain tool's step cut says that the micro-batches were folded into one loop, or that they were not."""
    from torch_xla_bridge.explain import explain

    details = {}
    for eager_loss in (False, True):
        torch._dynamo.reset()
        run = _Run(_model().to(torch_xla.device()), eager_loss=eager_loss)
        with warnings.catch_warnings(), explain() as ex:
            warnings.simplefilter("ignore")
            for s in range(3):
                run.step(_batches(4, seed=s))
        details[eager_loss] = [e.detail for e in ex.report.steps[-1].executions]
    assert len(details[False]) == 1 and "micro-batches folded into one loop" in details[False][0]
    assert len(details[True]) == 1 and "micro-batches not folded into one loop" in details[True][0]


def _example(name: str) -> types.ModuleType:
    """examples/NAME.py, loaded as a module."""
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hugging_face_trainer_folds_its_gradient_accumulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Trainer(gradient_accumulation_steps=4)`` with the model compiled by openxla_fused_step
    (examples/train_hf_trainer.py): 3 folds per optimizer step, the losses Trainer computes those of the same
    run with nothing folded (the first step's exactly), and the trained parameters within float rounding."""
    pytest.importorskip("transformers")
    from transformers import Trainer

    example = _example("train_hf_trainer")
    runs = {}
    for fold in (True, False):
        if not fold:
            _unfolded(monkeypatch)
        torch._dynamo.reset()
        losses: list[torch.Tensor] = []

        class Recording(Trainer):
            def training_step(self, *args, **kwargs):
                loss = super().training_step(*args, **kwargs)
                losses.append(loss)
                return loss

        folds0 = counter(names.FOLD_COUNTER)
        trainer = example.build(["--backend", FUSED_STEP, "--steps", "3", "--accumulate", "4"], trainer_cls=Recording)
        trainer.train()
        runs[fold] = ([t.item() for t in losses], counter(names.FOLD_COUNTER) - folds0,
                      [p.detach().cpu() for p in trainer.model.parameters()])
    (folded, folds, params), (unfolded, none, reference) = runs[True], runs[False]
    assert (folds, none) == (3 * (4 - 1), 0)
    # The first step's losses come from the same parameters: exactly equal. Later steps' come from parameters
    # that differ by the loop's rounding (below), so they may differ by as much (1 ulp measured on some CPUs).
    assert len(folded) == 3 * 4 and folded[:4] == unfolded[:4]
    assert folded == pytest.approx(unfolded, rel=1e-6)
    # XLA compiles the loop's body apart from the rest of the step and may round an op differently:
    # measured 1.2e-7 at most on parameters of magnitude up to 1 (bitwise on the MLP above).
    for a, b in zip(params, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_gradient_norm_kept_lazily_inside_the_loop_is_right() -> None:
    """A per-micro-batch ``p.grad.norm()`` kept unread until after the step reads the loop as it was at its
    micro-batch (docs/fused_step.md: the program then computes the loop up to each): the norms are those of
    eager CPU, still one execution per step."""
    cpu = _model()
    run = _Run(copy.deepcopy(cpu).to(torch_xla.device()))
    model = run.model
    kept: list[torch.Tensor] = []
    data = [_batches(3, seed=s) for s in range(3)]
    for batches in data:
        run.step(batches, inside=lambda: kept.append(model[0].weight.grad.norm()))
    assert run.executions[1:] == [1, 1]
    assert [t.item() for t in kept] == pytest.approx(_eager_cpu_grad_norms(cpu, data), rel=1e-5)


def test_accelerate_accumulate_folds_when_a_steps_batches_are_taken_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accelerate's ``accumulate()`` loop (examples/train_accelerate.py, 4 micro-batches, GPT-2 compiled by
    openxla_fused_step). Its XLA loader (torch_xla's MpDeviceLoader) syncs as each batch is taken: with a step's
    batches taken first (``--prefetch``, as Trainer does) the step is one execution with 3 folds; taken one at a
    time, each sync runs the micro-batch before it (4 executions per step, nothing folded). The losses are the
    same in both runs, up to the loop's rounding."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    example = _example("train_accelerate")
    runs = {}
    for prefetch in (True, False):
        torch._dynamo.reset()
        marks: list[int] = []
        folds0 = counter(names.FOLD_COUNTER)
        argv = ["--backend", FUSED_STEP, "--steps", "3", "--accumulate", "4"] + (["--prefetch"] if prefetch else [])
        losses = example.main(argv, on_step=lambda step: marks.append(executions()))
        runs[prefetch] = losses, [b - a for a, b in zip(marks, marks[1:])], counter(names.FOLD_COUNTER) - folds0
    (folded, per_step, folds), (unfolded, per_step_unfolded, none) = runs[True], runs[False]
    assert (per_step, folds) == ([1, 1], 3 * (4 - 1))
    assert (per_step_unfolded, none) == ([4, 4], 0)
    assert folded == pytest.approx(unfolded, rel=1e-6)
