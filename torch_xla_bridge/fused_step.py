"""The fused training step of ``openxla_fused_step``: one XLA execution per step.

Every graph this backend compiles is deferred (:class:`DeferredGraph`): the
forward's outputs, the saved activations included, are pending outputs of one
embedded computation; the backward consumes them as another; the autograd
engine's ``.grad`` accumulation and an eager optimizer's updates are lazy ops
on top. Nothing executes until the step is cut, and then everything pending
runs as one XLA execution, cached after warm-up.

The step is cut:

- at ``torch_xla.sync()`` / ``xm.mark_step()``, as with any lazy tensor;
- after a compiled graph that needs no backward (a compiled ``optimizer.step``,
  an evaluation forward): the graph joins the step, then the step is synced
  (after each such graph, where dynamo splits an optimizer step into several);
- before a forward whose parameters hold pending updates (an eager optimizer
  and no ``torch_xla.sync()``): the previous step is synced first, so one step
  never grows into the next;
- at a read of a value (``.item()``, ``.cpu()``, ``print``), which executes
  what that value needs. A read between a forward and the step's cut
  computes the forward twice (once for the read, once in the step); a graph
  where an execution is seen there is switched to ``openxla_fused_grad``
  behaviour (its forward executes on its own), with one warning.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

from .backend import STEP_BACKEND_NAME as BACKEND_NAME
from . import grad_sync
from .dynamo_bridge import DeferredBackward, DeferredGraph

log = logging.getLogger(__name__)

# A torch_xla counter (shown by metrics_report()) bumped by every step this backend cuts.
STEP_COUNTER = "OpenxlaFusedStepSync"


def end_step() -> None:
    """Cuts the step: everything pending on the device runs as one execution (asynchronously)."""
    torch_xla._XLAC._xla_increment_counter(STEP_COUNTER, 1)
    torch_xla.sync()


def _launches() -> int:
    """Executions of pending IR launched so far in this process.

    Every sync of a non-empty graph compiles it or finds it compiled
    (``UncachedCompile`` / ``CachedCompile``) on the calling thread, so unlike
    ``ExecuteTime`` these counters are exact the moment the sync returns, and
    reading them costs well under a microsecond. Upstream's bridge clears
    counters while it compiles a graph; a count that drops then can only hide
    a launch from the checks below, never invent one.
    """
    return (met.counter_value("UncachedCompile") or 0) + (met.counter_value("CachedCompile") or 0)


@dataclasses.dataclass
class _Pair:
    """State shared by the forward and backward graphs of one AOTAutograd compilation.

    ``launches_at_forward`` / ``launches_at_backward``: :func:`_launches` right
    after the latest deferred forward / the step's first backward. An
    execution of pending IR between a forward and its backward, or between the
    backward and the step's cut, most likely read the forward's outputs, and
    then the step computes the forward a second time.
    ``unfused_reason``: set once that was seen; the forward then executes its
    outputs at once instead.
    """

    launches_at_forward: Optional[int] = None
    launches_at_backward: Optional[int] = None
    unfused_reason: Optional[str] = None
    # At most one step closure queued per pair, even if no step is ever cut.
    closure_queued: bool = False

    def unfuse(self, reason: str) -> None:
        """Switches the forward to executing on its own; warns once."""
        if self.unfused_reason is not None:
            return
        self.unfused_reason = reason
        warnings.warn(
            f"{BACKEND_NAME}: {reason}, which computes the forward twice; from now on this graph's "
            f"forward executes on its own (openxla_fused_grad behaviour), backward, accumulation and "
            f"optimizer stay fused. Read values (e.g. loss.item()) after the optimizer step or "
            f"torch_xla.sync() to keep one execution per step."
        )

    def at_step_end(self) -> None:
        """A step closure: the cut is one execution; any other since the backward was a read."""
        self.closure_queued = False
        if self.launches_at_backward is not None and _launches() - self.launches_at_backward > 1:
            self.unfuse("a value was read (an XLA execution ran) between its backward and the end of the step")
        self.launches_at_backward = None

    def check_uncut_step(self) -> None:
        """At the next forward: the previous step ran, but was never cut (no step closure ran)."""
        if self.launches_at_backward is not None and _launches() > self.launches_at_backward:
            self.unfuse(
                "the step after its backward was executed by something other than torch_xla.sync() or a "
                "graph of this backend (e.g. an optimizer compiled with another backend, or a read)"
            )
        self.launches_at_backward = None


def _pending_parameters(args: Sequence[Any]) -> bool:
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad]
    return any(torch_xla._XLAC._check_tensor_need_materialization(leaves)) if leaves else False


class DeferredForward(DeferredGraph):
    """A training forward embedded into the step; its parameters never carry a previous step's IR.

    Invariant: its outputs are computed once per call, in the step's one
    execution, or (after a read between forward and backward was seen) in an
    execution of their own right away.
    """

    unfused_effect = "it executes on its own; backward, accumulation and optimizer stay fused"

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], pair: _Pair) -> None:
        super().__init__(gm, example_inputs, BACKEND_NAME)
        self.pair = pair

    def __call__(self, args: list) -> Any:
        if _pending_parameters(args):
            log.debug("parameters hold pending updates at a forward: syncing the previous step first")
            end_step()
        self.pair.check_uncut_step()
        return super().__call__(args)

    def _deferred(self, pending: list[torch.Tensor]) -> None:
        if self.pair.unfused_reason is not None:
            grad_sync.sync(pending)
        else:
            self.pair.launches_at_forward = _launches()


class StepBackward(DeferredBackward):
    """The backward of a fused step: deferred, synced by the step's cut, never at the end of the pass.

    It watches for executions between its forward and itself, and between
    itself and the step's cut (a step closure); if any ran, the forward is
    switched to executing on its own from the next call on, with one warning.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], pair: _Pair) -> None:
        super().__init__(gm, example_inputs, BACKEND_NAME, sync_at_end=False)
        self.pair = pair

    def __call__(self, args: list) -> Any:
        pair = self.pair
        if pair.launches_at_forward is not None and _launches() > pair.launches_at_forward:
            pair.unfuse("a value was read (an XLA execution ran) between its forward and backward")
        pair.launches_at_forward = None
        outs = super().__call__(args)
        if pair.unfused_reason is None and pair.launches_at_backward is None:
            pair.launches_at_backward = _launches()
            if not pair.closure_queued:
                pair.closure_queued = True
                xm.add_step_closure(pair.at_step_end)
        return outs


class StepEndGraph(DeferredGraph):
    """A graph that needs no backward (e.g. ``optimizer.step``): it joins the step, then ends it.

    Invariant: exactly one :func:`end_step` per call, after the graph's own
    work is part of the pending step (fused) or before it runs (upstream path,
    so that upstream's own input sync finds nothing left to run).
    """

    kind = "no-backward"
    unfused_effect = "the step is synced before it, and it executes on its own"

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        super().__init__(gm, example_inputs, BACKEND_NAME)

    def _deferred(self, pending: list[torch.Tensor]) -> None:
        end_step()

    def _run_upstream(self, args: list, reason: str) -> Any:
        end_step()
        return super()._run_upstream(args, reason)


def compilers() -> dict[str, Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[[list], Any]]]:
    """The forward, backward and inference compilers for one AOTAutograd compilation."""
    pair = _Pair()
    return dict(
        fw_compiler=lambda gm, example_inputs: DeferredForward(gm, example_inputs, pair),
        bw_compiler=lambda gm, example_inputs: StepBackward(gm, example_inputs, pair),
        inference_compiler=StepEndGraph,
    )
