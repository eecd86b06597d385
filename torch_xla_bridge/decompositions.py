"""AOTAutograd decompositions that give compiled XLA graphs eager PyTorch's numerics.

Both backends trace their forward and backward graphs with :data:`DECOMPOSITIONS`:
each entry replaces an ATen op whose torch_xla 2.9.0 lowering disagrees with eager
PyTorch (CPU or CUDA) by a composition of ops whose lowerings agree. Only ops with a
measured disagreement are listed (see ``docs/numerics.md`` for what was checked),
plus one op without an XLA lowering whose CPU fallback would unfuse a graph.

Invariants:

- every decomposition is a pure function of its inputs built from ops that XLA lowers
  natively (no CPU fallback, no host read, no in-place update), so a graph that uses it
  is still fused, and lowered once per input signature;
- a random decomposition draws from ``rand_like``, which is tagged
  ``nondeterministic_seeded`` and takes its seed from the device's base seed, so
  :func:`torch_xla_bridge.dynamo_bridge._seed_parameter` finds that seed and every call
  gets a fresh one; the mask is an output of the forward that the backward reuses;
- where an op's lowering is right for some arguments (BatchNorm outside training, say)
  its decomposition returns ``NotImplemented`` for them, which keeps the op itself.

This module imports only torch (it is read by :mod:`torch_xla_bridge.backend`, which
must load without torch_xla).
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Callable, Mapping, Optional

import torch
from torch._decomp import decompositions as _torch_decomps
from torch._prims_common import get_computation_dtype

log = logging.getLogger(__name__)

aten = torch.ops.aten

__all__ = [
    "DECOMPOSITIONS",
    "table",
    "native_dropout",
    "native_dropout_backward",
    "batch_norm_functional",
    "batch_norm_backward",
    "rrelu_with_noise_functional",
]


def native_dropout(input: torch.Tensor, p: float, train: Optional[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout``: keep with probability ``1 - p``, scale kept values by ``1 / (1 - p)``.

    What torch_xla lowers wrongly (``BuildNativeDropout``): it draws the keep mask with
    probability ``1 - p`` (right) but divides it by ``1 - (1 - p) = p``, so kept values
    are scaled by ``1 / p`` (p=0.1: 10.0 instead of 1.111), and it returns that scaled
    float mask where ATen returns a boolean one, so ``native_dropout_backward(grad,
    mask, scale)`` multiplies by the scale a second time (p=0.5: 4.0 instead of 2.0).
    Eager XLA ``F.dropout`` does not use this op (it goes through ``bernoulli_``) and is
    right; compiled graphs always contain it.

    Why this is right: it is ATen's reference decomposition (the one Inductor uses), a
    boolean mask ``rand > p`` is kept with probability ``1 - p``, and the output is
    ``mask * input / (1 - p)``, eager's ``native_dropout`` on CPU and CUDA.
    """
    return _torch_decomps.native_dropout(input, p, train)


def native_dropout_backward(grad_output: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``aten.native_dropout_backward``: ``grad * mask * scale`` for a boolean (or 0/1) ``mask``.

    Decomposed together with :func:`native_dropout` so that the backward is a plain
    multiply by the forward's saved boolean mask, whatever torch_xla's lowering of the
    backward op assumes about its mask (its forward returns a pre-scaled one).
    """
    return _torch_decomps.native_dropout_backward(grad_output, mask, scale)


def batch_norm_functional(
    input: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> object:
    """``aten._native_batch_norm_legit_functional`` in training: running variance from the unbiased variance.

    What torch_xla lowers wrongly: in training it updates ``running_var`` with the
    batch's biased variance (divided by ``n``), eager XLA and compiled alike; eager
    PyTorch uses the unbiased one (divided by ``n - 1``, ``n`` = elements per channel),
    so after one step on a batch of 8 the running variance moves by 7/8 of eager's
    update. Output, saved statistics and gradients are right.

    Why this is right: the output and the saved mean and inverse standard deviation
    still come from torch_xla's own ``native_batch_norm`` (called without running
    statistics, so it updates nothing), so forward and backward are upstream's HLO,
    bit for bit; the running statistics are eager's formula,
    ``(1 - momentum) * running + momentum * statistic`` with the batch mean and the
    unbiased variance (``correction=1``), accumulated in the computation dtype (float32
    for half-precision inputs) as eager's kernels do. Outside training ``NotImplemented``
    keeps the op, whose lowering is right.
    """
    if not training:
        return NotImplemented
    output, save_mean, save_invstd = aten.native_batch_norm.default(
        input, weight, bias, None, None, True, momentum, eps
    )
    reduction_dims = [0] + list(range(2, input.dim()))
    acc = input.to(get_computation_dtype(input.dtype))
    unbiased_var = torch.var(acc, reduction_dims, correction=1)
    new_running_mean = momentum * save_mean.to(acc.dtype) + (1 - momentum) * running_mean
    new_running_var = momentum * unbiased_var + (1 - momentum) * running_var
    return (
        output,
        save_mean,
        save_invstd,
        new_running_mean.to(running_mean.dtype),
        new_running_var.to(running_var.dtype),
    )


def batch_norm_backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    weight: Optional[torch.Tensor],
    running_mean: Optional[torch.Tensor],
    running_var: Optional[torch.Tensor],
    save_mean: Optional[torch.Tensor],
    save_invstd: Optional[torch.Tensor],
    train: bool,
    eps: float,
    output_mask: list[bool],
) -> object:
    """``aten.native_batch_norm_backward`` in evaluation mode (``train=False``), from the running statistics.

    What torch_xla lowers wrongly: its lowering normalizes with ``save_mean`` and
    ``save_invstd`` whatever ``train`` says, but in evaluation mode the forward
    (``_native_batch_norm_legit_no_training``) saves empty tensors there, as on CPU, and
    the backward fails ("The size of mean should be compatible with feature count, but
    the size of offset factor is 0"): a BatchNorm in ``eval()`` inside a model that is
    trained (frozen statistics while fine-tuning) cannot be differentiated on XLA,
    eager or compiled.

    Why this is right: ATen's reference decomposition uses ``running_mean`` and
    ``rsqrt(running_var + eps)`` when ``train`` is false, as the CPU kernel does. In
    training mode ``NotImplemented`` keeps torch_xla's own lowering, which is right.
    """
    if train:
        return NotImplemented
    return _torch_decomps.native_batch_norm_backward(
        grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, output_mask
    )


def rrelu_with_noise_functional(
    self: torch.Tensor,
    noise: torch.Tensor,
    lower: float = 0.125,
    upper: float = 1.0 / 3.0,
    training: bool = False,
    generator: Optional[torch.Generator] = None,
) -> object:
    """``aten.rrelu_with_noise_functional`` in training: slopes drawn on the device.

    What torch_xla lacks: a lowering of ``rrelu_with_noise`` (it runs as a CPU fallback,
    numerically right), so a compiled graph with ``F.rrelu(training=True)`` cannot be
    lowered as one computation and ``openxla_fused_step`` had to run its forward on its
    own. Not a numerics fix: it keeps the graph fused.

    Why this is right: as ATen's CPU kernel, each non-positive input is multiplied by a
    slope drawn uniformly from ``[lower, upper)`` and the slope is returned as ``noise``
    (1 for positive inputs), which ``rrelu_with_noise_backward`` multiplies the
    gradient by. The slope comes from ``rand_like``, so the graph's seed is found and
    refreshed per call. Outside training, or with an explicit generator (which XLA
    cannot honour), ``NotImplemented`` keeps the op.
    """
    if not training or generator is not None:
        return NotImplemented
    not_positive = self <= 0
    slope = lower + (upper - lower) * torch.rand_like(self)
    return torch.where(not_positive, self * slope, self), torch.where(not_positive, slope, torch.ones_like(slope))


# Keyed by OpOverload; read-only, so that no caller can change what every graph gets.
DECOMPOSITIONS: Mapping[torch._ops.OpOverload, Callable[..., object]] = MappingProxyType(
    {
        aten.native_dropout.default: native_dropout,
        aten.native_dropout_backward.default: native_dropout_backward,
        aten._native_batch_norm_legit_functional.default: batch_norm_functional,
        aten.native_batch_norm_backward.default: batch_norm_backward,
        aten.rrelu_with_noise_functional.default: rrelu_with_noise_functional,
    }
)


def table() -> dict[torch._ops.OpOverload, Callable[..., object]]:
    """A fresh copy of :data:`DECOMPOSITIONS`, for ``aot_autograd(decompositions=...)``."""
    return dict(DECOMPOSITIONS)
