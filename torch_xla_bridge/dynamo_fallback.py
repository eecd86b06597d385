"""Where dynamo compiles less than the user asked for: which backend trains a parameter, and the give-ups.

Dynamo may run part of a compiled loop eagerly: a region under
``torch._dynamo.disable``, a frame with a graph break it cannot resume (inside
a ``for`` over an ``nn.Sequential``: then it compiles no graph of it at all),
and every function it has compiled ``torch._dynamo.config.recompile_limit``
times (8): each failed guard (a new input shape, a new value of a float it
specialized on, such as a scheduler's ``lr`` or OneCycleLR's ``betas``) is a
new compilation, and at the limit it gives up on the function, which then runs
eagerly wherever no earlier compilation's guards hold (its callees too), for
the rest of the process. Under the fused backends that part of the step runs
as lazy tensor ops, which the step policies keep in the step
(:mod:`.fused_step`, :mod:`.optimizer_sync`: the step is still cut when the
optimizer step ends, whatever ran eagerly). For that they need to know which
backend a loop's parameters are trained with where no graph of the backend
runs: :func:`frame_started` records it when dynamo starts compiling a frame
(its module's or optimizer's parameters), before it traces anything.

Done here at the moment dynamo gives up on a function compiled with one of
the backends:

- an optimizer's step: its step counts go back to the host. Dynamo moves them
  onto the parameters' device whenever it compiles a step of an optimizer that
  has state (``move_step_if_cpu``), which a compiled step reads as data; an
  eager step of a non-capturable optimizer reads each one with ``.item()``,
  one execution per parameter. On the host they are what an optimizer that
  was never compiled has.
- one warning per function, naming it, the limit and the guard that failed
  last, with the fixes the user has (:func:`advice`).

Dynamo reports a give-up only through its warning record on the
``torch._dynamo.convert_frame`` logger, which names function, limit and guard:
a :class:`logging.Filter` there observes it (and never suppresses it). Where a
user silences dynamo's warnings, the step policies hold all the same; only
this module's warning and the step counts' move are lost.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
import weakref
from typing import Any, Iterator, Optional

import torch

from . import _private, counting, grad_sync
from .names import BACKEND_NAMES, DYNAMO_GAVE_UP_COUNTER, STEP_BACKEND_NAME

log = logging.getLogger(__name__)


# The backend that dynamo last started compiling a frame of each parameter's module or optimizer
# with: id(parameter) -> (a weak reference to it, the backend). By id, as a tensor's == compares values;
# entries whose parameter died are dropped at the next record.
_trained_with: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}


def frame_started() -> Optional[str]:
    """At the start of dynamo's compile of a frame: records its backend for the parameters of the modules and
    optimizers among the frame's locals; returns the backend's name if it is one of this package's."""
    local, backend = _private.frame_being_compiled()
    if not backend:
        return None
    for key in [k for k, (ref, _) in _trained_with.items() if ref() is None]:
        del _trained_with[key]
    for p in _parameters(local):
        _trained_with[id(p)] = (weakref.ref(p), backend)
    if backend not in BACKEND_NAMES:
        return None
    watch()
    return backend


def trained_with(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """The backend the parameters ``optimizer`` updates were last compiled with (its first parameter with a
    gradient: one loop trains them all), None if dynamo never started compiling them."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                ref, backend = _trained_with.get(id(p), (None, None))
                return backend if ref is not None and ref() is p else None
    return None


def _parameters(local: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The parameters of the modules and optimizers among a frame's locals (and a wrapper's ``args``)."""
    for v in [*local.values(), *_wrapper_args(local)]:
        if isinstance(v, torch.nn.Module):
            yield from v.parameters()
        elif isinstance(v, torch.optim.Optimizer):
            for group in v.param_groups:
                yield from group["params"]


def _wrapper_args(local: dict[str, Any]) -> list[Any]:
    """A wrapper's positional arguments (``def wrapper(*args, **kwargs)``, as torch.optim's), if the frame has them."""
    args = local.get("args")
    return list(args) if isinstance(args, tuple) else []


def watch() -> None:
    """Observes dynamo's give-ups from now on; idempotent (one filter per process)."""
    dynamo_log = logging.getLogger(_private.DYNAMO_FRAME_LOGGER)
    if _FILTER not in dynamo_log.filters:
        dynamo_log.addFilter(_FILTER)


@dataclasses.dataclass(frozen=True)
class GiveUp:
    """Dynamo's report that it stops compiling ``function`` (compiled with ``backend``) at ``limit``."""

    limit: str  # the config's name: "recompile_limit"
    value: Any  # its value
    function: str  # as dynamo names it: "'step' (.../adam.py:213)"
    guard: str  # the guard that failed last
    backend: str
    optimizer: Optional[torch.optim.Optimizer]  # the optimizer whose step it is, if it is one


def give_up_of(record: logging.LogRecord) -> Optional[GiveUp]:
    """The give-up ``record`` reports, read while dynamo compiles the frame; None for any other record."""
    hit = _private.recompile_limit_hit(record)
    if hit is None:
        return None
    local, backend = _private.frame_being_compiled()
    return GiveUp(*hit, backend=backend, optimizer=_optimizer_of(local))


class _GiveUpFilter(logging.Filter):
    """Sees every record of dynamo's frame-conversion logger; acts on a give-up in a fused backend."""

    def filter(self, record: logging.LogRecord) -> bool:
        give_up = give_up_of(record)
        if give_up is not None and give_up.backend in BACKEND_NAMES:
            gave_up(give_up)
        return True  # dynamo's own warning is printed as always


_FILTER = _GiveUpFilter()


def gave_up(g: GiveUp) -> None:
    """Dynamo stopped compiling a function of one of the backends: step counts to the host, one warning."""
    counting.bump(DYNAMO_GAVE_UP_COUNTER)
    if g.optimizer is not None:
        host_step_counts(g.optimizer)
    _warn_once(g.backend, g.function, advice(g.backend, g.limit, g.value, g.function, g.guard, g.optimizer is not None))


def advice(backend: str, limit: str, value: Any, function: str, guard: str, is_optimizer: bool) -> str:
    """The warning: what dynamo gave up on and why, what the backend does now, and the user's fixes."""
    head = (
        f"{backend}: dynamo stopped compiling {function} after torch._dynamo.config.{limit}={value} "
        f"compilations (the guard that failed last: {guard}); from now on it runs eagerly wherever no "
        f"earlier compilation fits. "
    )
    if is_optimizer:
        kept = (
            "The optimizer step runs as an uncompiled one does under this backend: the step is still cut "
            "when it ends, one execution per step"
            if backend == STEP_BACKEND_NAME
            else "The optimizer step runs as an uncompiled one does under this backend: its update is "
            "synced with the step when it ends"
        )
        fixes = (
            "To keep it compiled, pass changing hyperparameters as tensors, which schedulers update in place "
            "(`torch.optim.AdamW(params, lr=torch.tensor(1e-3))`), and fix the ones schedulers cycle "
            "(OneCycleLR/CyclicLR: `cycle_momentum=False`); or keep the optimizer eager"
            + (" (still one execution per step under this backend)" if backend == STEP_BACKEND_NAME else "")
            + "."
        )
    else:
        kept = (
            "Its ops run as lazy tensor ops in the same step, which is still cut when the optimizer step ends: "
            + ("one execution per step" if backend == STEP_BACKEND_NAME else "no step grows into the next")
            + "; each new input shape of the eager part compiles its step's XLA graph once"
        )
        fixes = (
            "For inputs of varying length: pad or bucket them to a few lengths, or mark the varying "
            "dimension dynamic before the call (`torch._dynamo.mark_dynamic(x, dim)`: one dynamo graph, one "
            "XLA compilation per new length); or raise torch._dynamo.config.recompile_limit above the number "
            "of shapes (each compiles once)."
            if "size mismatch" in guard or "stride mismatch" in guard
            else "Remove what changes between calls (a Python float or int argument: pass a tensor), or raise "
            "torch._dynamo.config.recompile_limit above the number of variants (each compiles once)."
        )
    return f"{head}{kept}. {fixes}"


@functools.cache
def _warn_once(backend: str, function: str, message: str) -> None:
    warnings.warn(message, stacklevel=2)


def _optimizer_of(local: dict[str, Any]) -> Optional[torch.optim.Optimizer]:
    """The optimizer whose step a given-up frame runs: its ``self``, or the first argument of a wrapper."""
    candidates = [local.get("self"), *_wrapper_args(local)[:1]]
    return next((c for c in candidates if isinstance(c, torch.optim.Optimizer)), None)


def host_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """Moves the device step counts of ``optimizer``'s non-capturable groups to the host, as a never-compiled
    optimizer keeps them (module docstring). Pending counts are synced first, in one execution."""
    counts = [
        (state, state["step"])
        for group in optimizer.param_groups
        if not group.get("capturable", False) and not group.get("fused", False)
        for p in group["params"]
        for state in [optimizer.state.get(p)]
        if state and isinstance(state.get("step"), torch.Tensor) and state["step"].device.type == "xla"
    ]
    if not counts:
        return
    pending = [t for (_, t), p in zip(counts, _private.need_materialization([t for _, t in counts])) if p]
    grad_sync.sync(pending)
    for state, step in counts:
        state["step"] = step.cpu()
    log.debug("moved %d step counts of %s to the host", len(counts), type(optimizer).__name__)
