"""Ops common in training graphs, compiled on XLA, against eager CPU: forward, gradients, buffers.

Deterministic ops are compared value by value with eager CPU (``DETERMINISTIC``);
random ops, whose streams differ between devices, are checked for the properties
eager CPU has (``RANDOM``): exact scale of kept values, kept fraction within
statistical bounds, and a backward that reuses the forward's mask.

Used by ``test/test_eager_numerics.py``; run as a script it prints the table of
``docs/numerics.md`` for eager XLA, upstream ``openxla`` and both our backends::

    PJRT_DEVICE=CPU python test/numerics_survey.py
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import sys
import warnings
from typing import Callable, Optional, Sequence

os.environ.setdefault("PJRT_DEVICE", "CPU")
# Run as a script, the worktree's package must win over any installed copy.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402

import torch_xla_bridge  # noqa: E402,F401
from torch_xla_bridge.names import BACKEND_NAMES, UPSTREAM_BACKEND_NAME  # noqa: E402

EAGER_XLA = "eager XLA"
BACKENDS = (EAGER_XLA, UPSTREAM_BACKEND_NAME, *BACKEND_NAMES)
RTOL, ATOL = 1e-5, 1e-5

# The autograd engine sizes its device queues at its first backward: the XLA
# device must exist before an eager CPU reference runs one.
torch_xla.device()


def _sync() -> None:
    torch_xla.sync()


def _compile(fn: Callable, backend: str) -> Callable:
    if backend == EAGER_XLA:
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend)


# --- deterministic ops: value by value against eager CPU -------------------------------


@dataclasses.dataclass
class Deterministic:
    """A module and its inputs; ``steps`` training forwards+backwards, then its state is compared."""

    name: str
    make: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    steps: int = 2
    train: bool = True


def _float_input(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).requires_grad_()


class _CrossEntropy(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)
        self.kw = kw

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc(x), target, **self.kw)


class _Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx)


def _tokens() -> torch.Tensor:
    t = torch.randint(0, 10, (6, 5))
    t[:, 0] = 0  # the padding index appears
    return t


DETERMINISTIC: list[Deterministic] = [
    Deterministic("BatchNorm1d (train, batch 8)", lambda: (nn.BatchNorm1d(4), (_float_input(8, 4),))),
    Deterministic("BatchNorm2d (train)", lambda: (nn.BatchNorm2d(3), (_float_input(4, 3, 5, 5),))),
    Deterministic("BatchNorm1d (eval)", lambda: (nn.BatchNorm1d(4), (_float_input(8, 4),)), train=False),
    Deterministic("LayerNorm", lambda: (nn.LayerNorm(6), (_float_input(4, 3, 6),))),
    Deterministic("GroupNorm", lambda: (nn.GroupNorm(2, 4), (_float_input(3, 4, 5),))),
    Deterministic("RMSNorm", lambda: (nn.RMSNorm(6), (_float_input(4, 3, 6),))),
    Deterministic(
        "InstanceNorm2d (running stats)",
        lambda: (nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (_float_input(2, 3, 4, 4),)),
    ),
    Deterministic("Embedding (padding_idx)", lambda: (_Embedding(), (_tokens(),))),
    Deterministic(
        "cross_entropy (label_smoothing, ignore_index)",
        lambda: (
            _CrossEntropy(label_smoothing=0.1, ignore_index=2),
            (_float_input(6, 8), torch.tensor([0, 2, 1, 4, 2, 3])),
        ),
    ),
    Deterministic("GELU (tanh)", lambda: (nn.GELU(approximate="tanh"), (_float_input(4, 6),))),
]


def run_deterministic(case: Deterministic, backend: Optional[str]) -> dict[str, torch.Tensor]:
    """Outputs, gradients (parameters and inputs) and buffers after ``case.steps`` steps; ``None``: eager CPU."""
    torch.manual_seed(0)
    module, inputs = case.make()
    module.train(case.train)
    weights = None
    dev = torch.device("cpu") if backend is None else torch_xla.device()
    module = copy.deepcopy(module).to(dev)
    xs = [x.detach().to(dev).requires_grad_(x.requires_grad) for x in inputs]
    fn = module if backend is None else _compile(module, backend)
    result: dict[str, torch.Tensor] = {}
    for step in range(case.steps):
        out = fn(*xs)
        if weights is None:  # a fixed random cotangent, so that every gradient entry matters
            weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dev)
        (out * weights).sum().backward()
        if backend is not None:
            _sync()
        result[f"out{step}"] = out.detach().cpu()
    for name, p in module.named_parameters():
        result[f"grad {name}"] = p.grad.cpu()
    for i, x in enumerate(xs):
        if x.requires_grad:
            result[f"grad input{i}"] = x.grad.cpu()
    for name, b in module.named_buffers():
        result[f"buffer {name}"] = b.cpu()
    return result


def deterministic_mismatches(case: Deterministic, backend: str) -> list[str]:
    """What differs from eager CPU beyond ``RTOL``/``ATOL``, one line per tensor (empty: agrees)."""
    want = run_deterministic(case, None)
    got = run_deterministic(case, backend)
    bad = []
    for key, w in want.items():
        g = got[key]
        if not torch.allclose(g, w.to(g.dtype), rtol=RTOL, atol=ATOL):
            err = (g.double() - w.double()).abs().max().item()
            bad.append(f"{key}: max abs error {err:.3g}")
    return bad


# --- random ops: eager CPU's properties -------------------------------------------------


def kept_fraction_ok(kept: int, total: int, p: float, sigmas: float = 5.0) -> bool:
    """True if ``kept`` of ``total`` is within ``sigmas`` binomial standard deviations of ``1 - p``."""
    sd = math.sqrt(p * (1 - p) / total)
    return abs(kept / total - (1 - p)) <= sigmas * sd


def _grad_of_sum(fn: Callable, x: torch.Tensor, backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x)`` and d(sum fn(x))/dx, for ``x`` copied to the backend's device."""
    dev = torch.device("cpu") if backend is None else torch_xla.device()
    x = x.detach().to(dev).requires_grad_()
    f = fn if backend is None else _compile(fn, backend)
    out = f(x)
    out.sum().backward()
    if backend is not None:
        _sync()
    return out.detach().cpu(), x.grad.cpu()


def check_dropout(backend: Optional[str], p: float, n: int = 20000) -> list[str]:
    """``F.dropout``: kept values exactly ``x / (1 - p)``, kept fraction ``1 - p``, grad ``mask / (1 - p)``."""
    x = torch.rand(n) + 0.5
    out, grad = _grad_of_sum(lambda t: F.dropout(t, p, training=True), x, backend)
    mask = out != 0
    scale = 1.0 / (1.0 - p)
    bad = []
    ratio = (out[mask] / x[mask]).unique()
    if not torch.allclose(out[mask], x[mask] * scale, rtol=1e-6, atol=0):
        bad.append(f"scale {ratio[:3].tolist()} instead of {scale:.4g}")
    if not kept_fraction_ok(int(mask.sum()), n, p):
        bad.append(f"kept fraction {mask.float().mean().item():.4f} instead of {1 - p}")
    if not torch.allclose(grad, mask.float() * scale, rtol=1e-6, atol=0):
        bad.append(f"gradient {grad[mask].unique()[:3].tolist()} where kept, instead of {scale:.4g}")
    return bad


def check_feature_dropout(backend: Optional[str], p: float = 0.3) -> list[str]:
    """``F.dropout2d``: whole channels kept with ``1 - p``, scaled by ``1 / (1 - p)``; grad uses that mask."""
    x = torch.rand(64, 32, 3, 3) + 0.5
    out, grad = _grad_of_sum(lambda t: F.dropout2d(t, p, training=True), x, backend)
    mask = out != 0
    per_channel = mask.flatten(2)
    bad = []
    if not (per_channel.all(-1) | ~per_channel.any(-1)).all():
        bad.append("mask not constant over a channel")
    if not torch.allclose(out[mask], x[mask] / (1 - p), rtol=1e-6, atol=0):
        bad.append(f"scale {(out[mask] / x[mask]).unique()[:3].tolist()} instead of {1 / (1 - p):.4g}")
    if not kept_fraction_ok(int(per_channel.all(-1).sum()), 64 * 32, p):
        bad.append(f"kept channel fraction {per_channel.all(-1).float().mean().item():.4f} instead of {1 - p}")
    if not torch.allclose(grad, mask.float() / (1 - p), rtol=1e-6, atol=0):
        bad.append("gradient is not mask / (1 - p)")
    return bad


def _alpha_check(backend: Optional[str], fn: Callable, x: torch.Tensor, p: float, kept_of: Callable) -> list[str]:
    want_out, want_grad = _grad_of_sum(fn, x, None)
    out, grad = _grad_of_sum(fn, x, backend)
    # x is constant, so eager CPU gives exactly two values: kept and dropped; so must we.
    bad = []
    values, want_values = out.unique(), want_out.unique()
    if values.numel() != want_values.numel() or not torch.allclose(values, want_values, rtol=1e-6, atol=1e-6):
        bad.append(f"values {values[:3].tolist()} instead of eager's {want_values.tolist()}")
        return bad
    kept_value = want_out[want_grad != 0][0]  # eager's gradient is nonzero exactly where kept
    kept = torch.isclose(out, kept_value, rtol=1e-6, atol=1e-6)
    kept_units = kept_of(kept)
    if not kept_fraction_ok(int(kept_units.sum()), kept_units.numel(), p):
        bad.append(f"kept fraction {kept_units.float().mean().item():.4f} instead of {1 - p}")
    a = want_grad[want_grad != 0].unique()
    if not torch.allclose(grad, kept.float() * a, rtol=1e-6, atol=1e-7):
        bad.append(f"gradient {grad.unique()[:3].tolist()} instead of {a.tolist()} where kept, 0 elsewhere")
    return bad


def check_alpha_dropout(backend: Optional[str], p: float = 0.3) -> list[str]:
    """``F.alpha_dropout``: the same two output values as eager CPU, kept fraction, grad on kept elements."""
    return _alpha_check(backend, lambda t: F.alpha_dropout(t, p, training=True), torch.full((20000,), 0.7), p, lambda k: k)


def check_feature_alpha_dropout(backend: Optional[str], p: float = 0.3) -> list[str]:
    """``F.feature_alpha_dropout``: as alpha dropout, per channel."""
    return _alpha_check(
        backend,
        lambda t: F.feature_alpha_dropout(t, p, training=True),
        torch.full((64, 32, 3), 0.7),
        p,
        lambda k: k[..., 0],
    )


def check_sdpa_dropout(backend: Optional[str], p: float = 0.1) -> list[str]:
    """``scaled_dot_product_attention(dropout_p=p)`` with uniform attention over ``L`` keys and ``v = 1``.

    Each output is ``k / (L (1 - p))`` for the number ``k`` of kept keys in its row, so
    ``out * L * (1 - p)`` must be an integer in ``[0, L]``; the gradient of ``v`` sums
    the same dropped weights over queries, so its total equals the outputs' total.
    """
    length, dim = 16, 4

    def fn(v: torch.Tensor) -> torch.Tensor:
        q = torch.zeros_like(v)  # all scores equal: uniform attention
        return F.scaled_dot_product_attention(q, q, v, dropout_p=p)

    out, grad = _grad_of_sum(fn, torch.ones(8, 2, length, dim), backend)
    bad = []
    counts = out * length * (1 - p)
    if not torch.allclose(counts, counts.round(), atol=1e-3) or counts.max() > length + 1e-3:
        k = (out * length)[out > 0].unique()[:2].tolist()
        bad.append(f"scale wrong: outputs times L are {k}, not multiples of 1/(1-p) = {1 / (1 - p):.4g}")
        return bad
    kept = int(counts[..., 0].round().sum())
    if not kept_fraction_ok(kept, 8 * 2 * length * length, p):
        bad.append(f"kept fraction {kept / (8 * 2 * length * length):.4f} instead of {1 - p}")
    if not math.isclose(out.sum().item(), grad.sum().item(), rel_tol=1e-5):
        bad.append("the gradient of v does not use the forward's dropped weights")
    return bad


def check_rrelu(backend: Optional[str], lower: float = 0.1, upper: float = 0.3) -> list[str]:
    """``F.rrelu(training=True)``: negative inputs scaled by a slope drawn from ``[lower, upper]``; grad is that slope."""
    x = torch.linspace(-2, 2, 20001)
    x = x[x != 0]
    out, grad = _grad_of_sum(lambda t: F.rrelu(t, lower, upper, training=True), x, backend)
    neg = x < 0
    slope = out[neg] / x[neg]
    bad = []
    if not torch.equal(out[~neg], x[~neg]) or not torch.equal(grad[~neg], torch.ones_like(grad[~neg])):
        bad.append("positive inputs changed")
    if slope.min() < lower - 1e-6 or slope.max() > upper + 1e-6:
        bad.append(f"slopes in [{slope.min().item():.3g}, {slope.max().item():.3g}] instead of [{lower}, {upper}]")
    elif abs(slope.mean().item() - (lower + upper) / 2) > 5 * (upper - lower) / math.sqrt(12 * slope.numel()):
        bad.append(f"mean slope {slope.mean().item():.4g} instead of {(lower + upper) / 2}")
    if not torch.allclose(grad[neg], slope, rtol=1e-5, atol=1e-6):
        bad.append("the gradient does not use the forward's slopes")
    return bad


RANDOM: dict[str, Callable[[Optional[str]], list[str]]] = {
    "dropout p=0.1": lambda b: check_dropout(b, 0.1),
    "dropout p=0.5": lambda b: check_dropout(b, 0.5),
    "dropout p=0.9": lambda b: check_dropout(b, 0.9),
    "dropout2d (feature dropout)": check_feature_dropout,
    "alpha_dropout": check_alpha_dropout,
    "feature_alpha_dropout": check_feature_alpha_dropout,
    "scaled_dot_product_attention (dropout_p=0.1)": check_sdpa_dropout,
    "rrelu (training)": check_rrelu,
}


def unfused_warnings(caught: Sequence[warnings.WarningMessage]) -> list[str]:
    """Our backends' warnings that a graph left the fused path (none expected for these ops)."""
    return [str(w.message) for w in caught if "runs unfused" in str(w.message)]


def _reported(check: Callable[[], list[str]]) -> list[str]:
    """The check's mismatches plus any fallback warning, or the error it raised."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bad = check()
        return bad + [f"warns: {m[:120]}" for m in unfused_warnings(caught)]
    except Exception as e:  # a failing op is a finding of the survey, not its end
        return [f"fails: {str(e).splitlines()[0][:120]}"]


def survey(backends: Sequence[str] = BACKENDS) -> list[tuple[str, dict[str, list[str]]]]:
    """Every case against eager CPU for each backend: ``(case, {backend: mismatches})``."""
    rows = []
    for name, check in RANDOM.items():
        rows.append((name, {b: _reported(lambda: check(b)) for b in backends}))
    for case in DETERMINISTIC:
        rows.append((case.name, {b: _reported(lambda: deterministic_mismatches(case, b)) for b in backends}))
    return rows


def main() -> None:
    rows = survey()
    print("| op | " + " | ".join(BACKENDS) + " |")
    print("|---|" + "---|" * len(BACKENDS))
    for name, results in rows:
        cells = ["ok" if not r else "; ".join(r) for r in (results[b] for b in BACKENDS)]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
