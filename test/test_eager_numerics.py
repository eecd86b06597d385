"""Both backends train like eager PyTorch on CPU where torch_xla's lowerings do not.

Random ops are checked for eager CPU's properties (exact scale, kept fraction within
statistical bounds, the backward reusing the forward's mask, a fresh mask per step);
deterministic ones value by value against eager CPU. See docs/numerics.md.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla.core.xla_model as xm

from limits import HANG_TIMEOUT_S
import numerics_survey as survey
from xla_helpers import FUSED, FUSED_STEP, cpu_and_xla_copy, device, executions, recorded_warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
BACKENDS = [FUSED, FUSED_STEP]
# Steady-state executions of one compiled forward + backward (+ mark_step): the
# forward and the fused backward; or the whole step as one.
EXECUTIONS = {FUSED: 2, FUSED_STEP: 1}
N = 20000


def _eager_cpu_scale(p: float) -> float:
    """What eager CPU multiplies kept values by (measured, not assumed)."""
    x = torch.rand(1000) + 0.5
    out = F.dropout(x, p, training=True)
    scales = (out[out != 0] / x[out != 0]).unique()
    assert torch.allclose(scales, scales[0])
    return scales[0].item()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_scale_fraction_and_mask_match_eager_cpu(backend, p):
    scale = _eager_cpu_scale(p)
    assert scale == pytest.approx(1 / (1 - p), rel=1e-6)
    x_cpu = torch.rand(N) + 0.5
    x = x_cpu.to(device()).requires_grad_()
    compiled = torch.compile(lambda t: F.dropout(t, p, training=True), backend=backend)
    masks, execs = [], []
    with recorded_warnings() as caught:
        for _ in range(3):
            x.grad = None
            e0 = executions()
            out = compiled(x)
            out.sum().backward()
            xm.mark_step()
            execs.append(executions() - e0)
            out, grad = out.detach().cpu(), x.grad.cpu()
            mask = out != 0
            # Kept values are exactly x * eager's scale, dropped ones 0.
            torch.testing.assert_close(out, x_cpu * mask * scale, rtol=1e-6, atol=0)
            # Binomial(N, 1 - p): 5 standard deviations.
            assert survey.kept_fraction_ok(int(mask.sum()), N, p), mask.float().mean()
            # The backward reuses the forward's mask, scaled once.
            torch.testing.assert_close(grad, mask.float() * scale, rtol=1e-6, atol=0)
            masks.append(mask)
    assert survey.unfused_warnings(caught) == []
    assert execs[1:] == [EXECUTIONS[backend]] * 2
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])  # fresh every step


@pytest.mark.parametrize("case", [c for c in survey.RANDOM if not c.startswith("dropout p=")])
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_op_matches_eager_cpu(backend, case):
    """Dropout variants, SDPA's attention dropout and rrelu: see numerics_survey.RANDOM."""
    with recorded_warnings() as caught:
        assert survey.RANDOM[case](backend) == []
    assert survey.unfused_warnings(caught) == []


@pytest.mark.parametrize("case", survey.DETERMINISTIC, ids=lambda c: c.name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_op_matches_eager_cpu(backend, case):
    """Outputs of two steps, every gradient and every buffer, to rtol/atol 1e-5."""
    with recorded_warnings() as caught:
        assert survey.deterministic_mismatches(case, backend) == []
    assert survey.unfused_warnings(caught) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_batchnorm_running_stats_match_eager_cpu(backend):
    """One training forward on a batch of 8: running_var takes the unbiased variance (n - 1 = 7)."""
    torch.manual_seed(0)
    x = torch.randn(8, 4) * 3 + 1
    want = nn.BatchNorm1d(4)
    got = copy.deepcopy(want).to(device())
    want(x)
    compiled = torch.compile(got, backend=backend)
    compiled(x.to(device()))
    xm.mark_step()
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(got, name).cpu(), getattr(want, name), rtol=0, atol=1e-6, msg=name)
    assert int(got.num_batches_tracked.cpu()) == 1
    # The update itself: 0.1 * unbiased variance + 0.9 * 1.
    torch.testing.assert_close(got.running_var.cpu(), 0.1 * x.var(0, unbiased=True) + 0.9, rtol=0, atol=1e-6)


class DropoutBNNet(nn.Module):
    """Linear, BatchNorm, ReLU, dropout, Linear; returns the dropout's output too, so its mask can be replayed."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.drop(F.relu(self.bn(self.fc(x))))
        return self.head(h), h


class ReplayDropout(nn.Module):
    """Eager CPU's dropout with a given mask: ``x * mask / (1 - p)``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask / (1 - self.p)


@dataclasses.dataclass
class ReplayedTraining:
    """A DropoutBNNet trained on XLA beside its eager CPU copy, which replays each XLA step's dropout mask.

    Both train with SGD(momentum); shared by this file and spmd_eager_numerics.py.
    """

    model: nn.Module
    compiled: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    reference: nn.Module
    replay: ReplayDropout
    opt: torch.optim.Optimizer
    ref_opt: torch.optim.Optimizer

    @classmethod
    def build(cls, backend: str, p: float) -> ReplayedTraining:
        reference, model = cpu_and_xla_copy(lambda: DropoutBNNet(p))
        replay = ReplayDropout(p)
        reference.drop = replay
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        return cls(model, torch.compile(model, backend=backend), reference, replay, opt, ref_opt)

    def xla_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step on the device, ended by ``mark_step``; returns the loss and the dropout's output."""
        self.opt.zero_grad()
        out, h = self.compiled(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        self.opt.step()
        xm.mark_step()
        return loss, h

    def cpu_step(self, x: torch.Tensor, y: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The same step on the CPU copy, with the mask of the XLA step's dropout output ``h``; returns the loss."""
        # A zero in h is a dropped unit, or a ReLU zero, for which the mask does not matter.
        self.replay.mask = (h.detach().cpu() != 0).float()
        self.ref_opt.zero_grad()
        loss = F.mse_loss(self.reference(x)[0], y)
        loss.backward()
        self.ref_opt.step()
        return loss


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_with_dropout_and_batchnorm_matches_eager_cpu(backend):
    """Four SGD(momentum) steps: parameters, BatchNorm buffers and losses as eager CPU with the same masks.

    The masks are random, so the CPU reference replays each step's mask, read off
    the compiled run's dropout output (a zero there is a dropped unit, or a ReLU
    zero, for which the mask does not matter).
    """
    p, steps = 0.3, 4
    run = ReplayedTraining.build(backend, p)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]
    execs, losses, ref_losses = [], [], []
    with recorded_warnings() as caught:
        for x, y in batches:
            e0 = executions()
            loss, h = run.xla_step(x.to(device()), y.to(device()))
            execs.append(executions() - e0)
            losses.append(loss.item())
            ref_losses.append(run.cpu_step(x, y, h).item())
    assert survey.unfused_warnings(caught) == []
    # forward, backward, eager optimizer at mark_step; or one execution per step.
    assert execs[2:] == [EXECUTIONS[backend] + (backend == FUSED)] * (steps - 2)
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    want = {k: v.detach() for k, v in run.reference.state_dict().items()}
    for name, value in run.model.state_dict().items():
        torch.testing.assert_close(value.cpu(), want[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    # Dropout was on: about 30% of the units that ReLU let through were dropped.
    assert 0.1 < 1 - run.replay.mask.mean().item() < 0.9


def test_spmd_training_with_dropout_and_batchnorm_matches_eager_cpu(tmp_path):
    """Under SPMD (batch sharded over a 4-device mesh) both backends still train like eager CPU."""
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "test" / "spmd_eager_numerics.py"), str(out)],
        env=dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4",
                 PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "test"), os.environ.get("PYTHONPATH", "")])),
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["devices"] == 4
    for backend, steady in ((FUSED, 3), (FUSED_STEP, 1)):  # same counts as without SPMD
        run = result[backend]
        assert run["executions"][2:] == [steady, steady], (backend, run)
        assert run["state_err"] < 1e-5, (backend, run)
        assert run["fresh_masks"] and run["unfused_warnings"] == [], (backend, run)
        assert run["dropout_scale_ok"] and run["dropout_grad_ok"], (backend, run)
        assert survey.kept_fraction_ok(round(run["dropout_kept"] * 4096), 4096, 0.1), (backend, run)
