"""Hugging Face Trainer and Accelerate train with this project's backends (examples/train_hf_trainer.py,
examples/train_accelerate.py): the same losses as upstream `openxla`, fewer XLA executions per
optimizer step, and with `openxla_fused_step` one execution per step beyond the framework's own syncs.

Each example runs a few steps of a 2-layer GPT-2 per backend, once per module (cached), so the
whole file is six short trainings.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Callable

import pytest
import torch._dynamo

from xla_helpers import FUSED, FUSED_STEP, UPSTREAM, executions

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS = 4  # step 1 compiles; steps 2-4 are the steady state

# Executions per optimizer step, steady state, measured on PJRT CPU (docs/frameworks/).
# GPT-2 from transformers compiles as two graphs (a graph break before the loss), so
# upstream pays a forward, an input sync and a backward for each, plus the optimizer.
EXPECTED = {
    ("trainer", UPSTREAM): 13,
    ("trainer", FUSED): 10,
    ("accelerate", UPSTREAM): 7,
    ("accelerate", FUSED): 4,
}


@dataclasses.dataclass
class FrameworkRun:
    losses: list[float]
    per_step: list[int]  # executions from one optimizer step's end to the next (steps 2..STEPS)
    framework: list[int]  # of those, the executions the framework makes on its own


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def deltas(marks: list[int]) -> list[int]:
    return [b - a for a, b in zip(marks, marks[1:])]


def run_trainer(backend: str) -> FrameworkRun:
    """Trainer, counting executions at each step's end and inside Trainer's own syncs.

    Trainer's own syncs (what it executes whatever the model does), per step with
    logging_steps=1: in `get_batch_samples`, torch_xla's MpDeviceLoader sync (which runs
    the reset of the logged loss) and the gather of the batch's label count; in
    `_nested_gather`, the logged loss's read and the two syncs of xm.mesh_reduce's
    rendezvous. The logging's `xm.mark_step()` is not counted: the step runs in it.
    """
    from transformers import Trainer, TrainerCallback

    marks: list[int] = []
    own: list[int] = []
    losses: list[torch.Tensor] = []

    class Recording(Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(loss)  # read after training: Trainer logs it rounded to 4 digits
            return loss

        def get_batch_samples(self, *args, **kwargs):
            before = executions()
            out = super().get_batch_samples(*args, **kwargs)
            own.append(executions() - before)
            return out

        def _nested_gather(self, *args, **kwargs):
            before = executions()
            out = super()._nested_gather(*args, **kwargs)
            own.append(executions() - before)
            return out

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(executions())

    trainer = load("train_hf_trainer").build(
        ["--backend", backend, "--steps", str(STEPS)], trainer_cls=Recording, callbacks=[StepEnd()]
    )
    trainer.train()
    # `own` holds, per step, get_batch_samples then _nested_gather; a step's interval
    # (end of step k to end of step k+1) holds step k's gather and step k+1's batch.
    per_interval = [own[2 * k + 1] + own[2 * k + 2] for k in range(STEPS - 1)]
    return FrameworkRun([loss.item() for loss in losses], deltas(marks), per_interval)


def run_accelerate(backend: str) -> FrameworkRun:
    """The Accelerate loop, counting executions after each step's `loss.item()`.

    Accelerate's only sync in this loop is its MpDeviceLoader's `torch_xla.sync()` per
    batch, which runs what the step left pending and nothing of its own: 0 per step.
    """
    marks: list[int] = []
    losses = load("train_accelerate").main(
        ["--backend", backend, "--steps", str(STEPS)], on_step=lambda step: marks.append(executions())
    )
    return FrameworkRun(losses, deltas(marks), [0] * (STEPS - 1))


RUNNERS: dict[str, Callable[[str], FrameworkRun]] = {"trainer": run_trainer, "accelerate": run_accelerate}
_runs: dict[tuple[str, str], FrameworkRun] = {}


def run(framework: str, backend: str) -> FrameworkRun:
    """One training per (framework, backend) per module: the tests below share them."""
    key = (framework, backend)
    if key not in _runs:
        torch._dynamo.reset()
        _runs[key] = RUNNERS[framework](backend)
        torch._dynamo.reset()
    return _runs[key]


def steady(counts: list[int]) -> int:
    """The one count of steps 2..STEPS; fails if they differ (recompiling, or a step growing)."""
    assert len(set(counts)) == 1, counts
    return counts[0]


@pytest.mark.parametrize("framework", ["trainer", "accelerate"])
@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_losses_match_upstream(framework, backend):
    ours, upstream = run(framework, backend), run(framework, UPSTREAM)
    assert len(ours.losses) == STEPS
    assert ours.losses == pytest.approx(upstream.losses, rel=1e-5)


@pytest.mark.parametrize("framework", ["trainer", "accelerate"])
@pytest.mark.parametrize("backend", [UPSTREAM, FUSED])
def test_executions_per_step(framework, backend):
    assert steady(run(framework, backend).per_step) == EXPECTED[framework, backend]


@pytest.mark.parametrize("framework", ["trainer", "accelerate"])
@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_fewer_executions_than_upstream(framework, backend):
    assert steady(run(framework, backend).per_step) < steady(run(framework, UPSTREAM).per_step)


def test_trainer_own_syncs_do_not_depend_on_the_backend():
    # 5 per step: what Trainer executes whatever the backend (see run_trainer).
    own = {backend: steady(run("trainer", backend).framework) for backend in (UPSTREAM, FUSED, FUSED_STEP)}
    assert own == {UPSTREAM: 5, FUSED: 5, FUSED_STEP: 5}


@pytest.mark.parametrize("framework", ["trainer", "accelerate"])
def test_fused_step_is_one_execution_beyond_the_framework_syncs(framework):
    result = run(framework, FUSED_STEP)
    assert steady(result.per_step) == 1 + steady(result.framework)
