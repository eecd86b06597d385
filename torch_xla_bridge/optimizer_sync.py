"""``openxla_fused_grad`` at an eager optimizer step: the step ends there, so no step grows into the next.

An eager optimizer (``torch.optim.AdamW``, not compiled) updates parameters and
its state (``exp_avg``, ``exp_avg_sq``) with lazy ops. Upstream's bridge syncs
the parameters at the next forward, as that graph's inputs, but the state is
no graph's input: in a script written for CUDA (no ``torch_xla.sync()``, as
nanoGPT's ``train.py``) its pending IR grows by one step per iteration, and
every parameter sync compiles a new, longer graph. So an optimizer step that
ends after a backward of this backend is a step barrier (``torch_xla.sync()``),
as it is for ``openxla_fused_step``: one execution holding the update, its
state and what ran on ``.grad`` in between (``clip_grad_norm_``), compiled once
and replayed every step after; the next forward finds nothing pending, and
values read after the step (``loss.item()``, the trained model) execute nothing.

Measured against syncing with everything pending at the next forward instead
(in place of upstream's input sync there): the same executions on a
nanoGPT-shaped loop, but the last step's update left pending, read tensor by
tensor after training; torch_xla 2.9 then gives wrong values for some of them
after ``clip_grad_norm_`` (half the elements off eager CPU by 2 lr after one
AdamW step, as upstream ``openxla``'s are; not diagnosed), which the barrier
here never lets happen. Its cost: where lazy work follows the optimizer step before a user's
own ``torch_xla.sync()`` (an EMA of the weights, a graph writing its inputs),
that work is one execution of its own.

A no-op while no backward of this backend ran since the last step barrier (so
optimizers trained with other backends, or none, are not affected), after a
compiled ``optimizer.step`` on one device (its graph leaves no lazy update),
and inside ``torch_xla.compile(fn)``, whose own sync ends the step. Under SPMD
a compiled step's write-back (AOTAutograd's ``copy_``) leaves parameters and
state pending as sharding annotations over the new buffers: the barrier then
syncs them all in one execution, where the next graphs reading them would
each sync theirs first (``test/test_spmd.py``: 4 executions per step, was 5).

When dynamo gives up on part of the loop (``recompile_limit``), that part runs
eagerly, and the barrier follows from what then runs: an optimizer step that
dynamo no longer compiles is an eager step after a fused backward; after a
forward it no longer compiles (no backward of this backend ran), an optimizer
whose parameters are trained with this backend (:mod:`.dynamo_fallback`) ends
its step with a barrier when its update is pending (:func:`update_pending`),
so no step grows into the next. The hook is
disabled for dynamo (``torch._dynamo.disable``), so it runs when the step ends
even where dynamo compiled the optimizer's wrapper and runs the step itself
eagerly.

The barrier launches the update's execution and returns: a pre-hook keeps the
parameters' and state's old buffers, which it donates (:mod:`.in_flight`), so
neither it nor the user's ``torch_xla.sync()`` after it waits for the execution.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional, Sequence

import torch
import torch_xla
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import _private, counting, dynamo_fallback, grad_sync, in_flight, rollback
from .names import BACKEND_NAME, OPTIMIZER_SYNC_COUNTER

log = logging.getLogger(__name__)


class _Trained:
    """Marks that a backward of this backend ran since the last step barrier.

    Strongly referenced only by its step closure, which torch_xla runs and
    drops at the next barrier: so :data:`_since_barrier` holds it exactly
    until then, and nothing of it outlives the step.
    """

    __slots__ = ("rollback", "__weakref__")

    def __init__(self) -> None:
        # What the step's backward syncs and its optimizer barrier write, put back if XLA refuses either.
        # Not the RNG seed: the step's forward drew from it before the first backward.
        self.rollback = rollback.Record(rng=False)

    def at_barrier(self) -> None:
        """The step closure: nothing to do, being dropped is the point."""

    def refused(self, error: RuntimeError, launches: int, compiled: bool) -> None:
        """XLA refused the step's backward or barrier (made after ``launches`` launches, compiled or not):
        what they wrote takes back its value from before, the step is over, and the error says so."""
        _since_barrier.discard(self)
        lost = self.rollback.restore(launches)
        raise rollback.refused_step_error(error, BACKEND_NAME, self.rollback.kept(), lost, compiled) from error


# The marker of the current step, if any (at most one member; see _Trained).
_since_barrier: weakref.WeakSet[_Trained] = weakref.WeakSet()


def update_pending(optimizer: torch.optim.Optimizer) -> bool:
    """At the end of ``optimizer``'s step: its update is pending IR, as an eager step leaves it.

    A compiled step (with any backend) leaves its parameters as device data on
    one device; under SPMD as pending sharding annotations (module docstring).
    Reads one parameter, the first with a gradient: a step updates every
    parameter with a gradient, all eagerly or all in one compiled graph.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return p.device.type == "xla" and _private.need_materialization([p])[0]
    return False


def _marker() -> _Trained:
    """The current step's marker, made (its step closure queued) if there is none."""
    for marker in _since_barrier:
        return marker
    marker = _Trained()
    _since_barrier.add(marker)
    _private.add_step_closure(marker.at_barrier)
    return marker


def backward_deferred(outputs: Sequence[torch.Tensor]) -> None:
    """``on_pending`` of a deferred backward: :func:`grad_sync.sync_at_end_of_backward`, with the step marked
    and the ``.grad`` its leaves hold before it kept (the engine has not accumulated into them yet)."""
    marker = _marker()
    register_hook()
    node = _private.current_autograd_node()
    if node is not None:
        marker.rollback.grads(fn.variable for fn, _ in node.next_functions if type(fn) is _private.AccumulateGrad)
    grad_sync.sync_at_end_of_backward(
        outputs, guard=lambda sync, tensors: rollback.guarded(sync, lambda: tensors, marker.refused))


@torch._dynamo.disable
def _barrier_after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: after a backward of this backend, the step ends (module docstring).

    Disabled for dynamo, so it runs when the step ends even where dynamo
    compiled the code around the step but runs the step itself eagerly.
    """
    if not _since_barrier and dynamo_fallback.trained_with(optimizer) != BACKEND_NAME:
        return
    if not update_pending(optimizer) or not _private.execution_allowed():
        return
    log.debug("optimizer step ended with its update pending: syncing the step")
    counting.bump(OPTIMIZER_SYNC_COUNTER)
    marker = next(iter(_since_barrier), None)
    # Keep a user's profiler scope (xp.Trace around the step), as upstream's bridge does.
    if marker is None:
        torch_xla.sync(reset_scope=False)
    else:
        rollback.guarded(lambda: torch_xla.sync(reset_scope=False), marker.rollback.written, marker.refused)


def _keep_before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: an eager step after a backward of this backend updates parameters
    and state in place, donating their buffers at the barrier: :func:`in_flight.keep` them. Nothing while
    dynamo traces the step (a compiled step's graph is upstream's, which executes at its call)."""
    if torch.compiler.is_compiling():
        return
    if _since_barrier or dynamo_fallback.trained_with(optimizer) == BACKEND_NAME:
        in_flight.keep_optimizer_update(optimizer)
        marker = next(iter(_since_barrier), None)
        if marker is not None:
            marker.rollback.optimizer(optimizer)


_hook: Optional[torch.utils.hooks.RemovableHandle] = None
_pre_hook: Optional[torch.utils.hooks.RemovableHandle] = None


def register_hook() -> None:
    """Registers :func:`_keep_before_optimizer_step` and :func:`_barrier_after_optimizer_step` once per process."""
    global _hook, _pre_hook
    if _hook is None:
        _pre_hook = register_optimizer_step_pre_hook(_keep_before_optimizer_step)
        _hook = register_optimizer_step_post_hook(_barrier_after_optimizer_step)
