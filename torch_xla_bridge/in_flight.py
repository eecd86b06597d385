"""Keeps the buffers a step's execution donates alive past its launch, so no thread waits for the execution.

A step's execution donates the old buffers of what it updates in place
(parameters, optimizer state, BatchNorm statistics) to their new values.
PJRT releases a donated buffer only once the execution that consumes it has
finished: whoever drops the *last* reference to one while it runs waits for
the whole execution. Without this module that is either

- torch_xla's asynchronous launch, whose task holds the inputs of the
  execution it launched, and the device lock with them, until it drops
  them: every later sync, even one with nothing to run (the user's
  ``xm.mark_step()`` after the fused step's cut), then waits at torch_xla's
  device barrier for the whole execution; or
- the Python thread itself, when the last reference dies there (a
  parameter's functional wrapper applying its pending update drops its old
  value), in the middle of the user's loop.

So the package keeps a reference of its own to each buffer a step will donate,
taken where the step writes the value in place (:func:`keep`), and drops it
at the step barrier after the next one (a step closure): after the launch of
the next step, when the execution that consumed it has most likely finished;
where it has not (the device is behind), the host waits there, with the next
step already queued behind it: one step in flight, as a jitted JAX step.

Invariants: only tensors without pending IR are held (a held tensor with
pending IR would be one more output of the step); what is held was captured
for the step barrier after which it is dropped, at most two barriers later
(`_captured` -> `_running` -> released), so nothing outlives two steps.
"""

from __future__ import annotations

import functools
import os
from typing import Iterable

import torch

from . import _private

# The old values (inner XLA tensors) captured since the last step barrier: the buffers the next
# execution donates. Moved to _running at that barrier (a step closure), released at the one after.
_captured: list[torch.Tensor] = []
_running: list[torch.Tensor] = []


def keep(tensors: Iterable[torch.Tensor]) -> None:
    """Holds the current buffers of ``tensors`` (their values *before* the in-place update about to be
    written) until the step barrier after the next one. Tensors with pending IR or off XLA are skipped."""
    if not _donating():
        return
    # ``is_xla``, not ``device.type``: this runs per step over every parameter and state tensor.
    inner = [_private.inner_value(t) for t in tensors if isinstance(t, torch.Tensor) and t.is_xla]
    if not inner:
        return
    with_data = [t for t, pending in zip(inner, _private.need_materialization(inner)) if not pending]
    if not with_data:
        return
    if not _captured:
        _private.add_step_closure(_at_barrier)
    _captured.extend(with_data)


@functools.cache
def _donating() -> bool:
    """Whether torch_xla donates updated buffers at a step barrier (``XLA_ENABLE_PARAM_ALIASING``, on by
    default; read once, as torch_xla does). Without donation no release waits, and holding a buffer
    would only keep its memory longer."""
    return os.environ.get("XLA_ENABLE_PARAM_ALIASING", "1").strip().lower() not in ("0", "false", "no", "off")


def _at_barrier() -> None:
    """Step closure: the barrier just launched the execution that donates ``_captured``; the previous
    barrier's buffers are released now (waiting here if that execution still runs)."""
    global _captured, _running
    released, _running, _captured = _running, _captured, []
    del released


def keep_optimizer_update(optimizer: torch.optim.Optimizer) -> None:
    """Before an eager optimizer step: :func:`keep` what it updates in place, its parameters with a
    gradient and their state tensors (step counts on the host are skipped)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    state = [t for p in params for t in optimizer.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
    keep([*params, *state])
