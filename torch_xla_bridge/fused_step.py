"""The fused training step of ``openxla_fused_step``: one XLA execution per step.

Every graph this backend compiles is deferred (:class:`DeferredGraph`): the
forward's outputs, the saved activations included, are pending outputs of one
embedded computation; the backward consumes them as another; the autograd
engine's ``.grad`` accumulation and an eager optimizer's updates are lazy ops
on top. Nothing executes until the step is cut, and then everything pending
runs as one XLA execution, cached after warm-up.

The step is cut (torch_xla's step barrier, which materializes every live tensor):

- when an optimizer step ends, eager (a global optimizer step post-hook) or
  compiled with this backend (the graph that updates its inputs joins the
  step, then cuts it; after each such graph, where dynamo splits an optimizer
  step into several), so ``loss.item()`` after ``optimizer.step()`` and a model
  read after training execute nothing;
- at ``torch_xla.sync()`` / ``xm.mark_step()``, as with any lazy tensor;
- before a forward whose parameters hold pending updates (e.g. parameters
  updated by hand, no sync): the previous step is synced first, so one step
  never grows into the next.

A graph that needs no backward and updates none of its inputs (an evaluation
forward, a checkpointed block's forward under ``no_grad``) joins an open step;
outside one it executes its own outputs at once, as upstream does.

A read of a value (``.item()``, ``.cpu()``, ``print``) executes what that value
needs. A read between a forward and the step's cut computes the forward twice
(once for the read, once in the step); a graph where that is seen is switched
to ``openxla_fused_grad`` behaviour (its forward executes on its own), with one
warning saying where (between forward and backward, or before the cut). A step
cut between a forward and its backward (another model's optimizer step in a GAN)
materializes the forward's outputs and costs nothing twice: it is not such a read.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import grad_sync
from .backend import STEP_BACKEND_NAME as BACKEND_NAME
from .dynamo_bridge import VALIDATION_COUNTER, DeferredBackward, DeferredGraph
from .names import FORWARD_ALONE_COUNTER

log = logging.getLogger(__name__)

# A torch_xla counter (shown by metrics_report()) bumped by every step this backend cuts.
STEP_COUNTER = "OpenxlaFusedStepSync"


def end_step() -> None:
    """Cuts the step: everything pending on the device runs as one execution (asynchronously)."""
    torch_xla._XLAC._xla_increment_counter(STEP_COUNTER, 1)
    # The cut can come from inside a user's profiler trace (xp.Trace around the step):
    # keep its IR scope, as upstream's bridge never resets one.
    torch_xla.sync(reset_scope=False)


def _launches() -> int:
    """Executions of pending IR launched so far in this process.

    Every sync of a non-empty graph compiles it or finds it compiled
    (``UncachedCompile`` / ``CachedCompile``) on the calling thread, so unlike
    ``ExecuteTime`` these counters are exact the moment the sync returns, and
    reading them costs well under a microsecond. Upstream's bridge clears
    counters while it compiles a graph; a count that drops then can only hide
    a launch from the checks below, never invent one. Compiles that only
    validate a new lowering launch nothing and are not counted.
    """
    compiles = (met.counter_value("UncachedCompile") or 0) + (met.counter_value("CachedCompile") or 0)
    return compiles - (met.counter_value(VALIDATION_COUNTER) or 0)


@dataclasses.dataclass
class _Pair:
    """State shared by the forward and backward graphs of one AOTAutograd compilation.

    ``launches_at_forward`` / ``forward_outputs``: :func:`_launches` right
    after the latest deferred forward, and its pending outputs (weakly). If,
    at the backward, an execution ran since then and some of those outputs
    are still pending, a read executed part of the forward, and the step will
    compute it again. ``launches_at_backward``: :func:`_launches` right after
    the step's first backward; more than one execution between it and the
    step's cut means a read there. ``unfused_reason``: set once either was
    seen; the forward then executes its outputs at once instead.
    """

    launches_at_forward: Optional[int] = None
    forward_outputs: list[weakref.ref[torch.Tensor]] = dataclasses.field(default_factory=list)
    launches_at_backward: Optional[int] = None
    unfused_reason: Optional[str] = None

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

    def forward_was_read(self) -> bool:
        """At the backward: an execution since the forward left some of its outputs pending."""
        if self.launches_at_forward is None or _launches() == self.launches_at_forward:
            return False
        alive = [t for t in (r() for r in self.forward_outputs) if t is not None]
        # A step cut materializes every live output; a read materializes only what it reads.
        return bool(alive) and any(torch_xla._XLAC._check_tensor_need_materialization(alive))

    def at_step_end(self) -> None:
        """At the step's cut: the cut is one execution; any other since the backward was a read."""
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


class _Step:
    """A step of this backend that is pending: graphs deferred since the last cut.

    Strongly referenced only by its step closure, which torch_xla runs and
    drops at the next step barrier (``torch_xla.sync()``, our cuts): so
    :data:`_open` holds it exactly while the step is pending, and nothing of
    it outlives the cut.
    """

    __slots__ = ("pairs", "__weakref__")

    def __init__(self) -> None:
        # Pairs whose backward joined this step, by identity.
        self.pairs: dict[int, _Pair] = {}

    def at_step_end(self) -> None:
        for pair in self.pairs.values():
            pair.at_step_end()


# The pending step, if any (at most one member; see _Step).
_open: weakref.WeakSet[_Step] = weakref.WeakSet()


def _current_step() -> _Step:
    """The pending step, opened (its step closure queued) if there is none."""
    for step in _open:
        return step
    step = _Step()
    _open.add(step)
    xm.add_step_closure(step.at_step_end)
    return step


def _cut_after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step post-hook: an optimizer step ends the pending step of this backend.

    A no-op while dynamo traces (a compiled ``optimizer.step`` cuts in its own
    graph) and when no step of this backend is pending, so optimizers trained
    with other backends, or none, are not affected.
    """
    if torch.compiler.is_compiling():
        return
    if _open:
        end_step()


_optimizer_hook: Optional[torch.utils.hooks.RemovableHandle] = None


def _register_optimizer_hook() -> None:
    """Registers :func:`_cut_after_optimizer_step` once per process."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_post_hook(_cut_after_optimizer_step)


def _pending_parameters(args: Sequence[Any]) -> bool:
    # Parameters only: a checkpointed block's recomputation gets its input as a
    # detached leaf that requires grad and is pending, which is no update.
    params = [a for a in args if isinstance(a, torch.nn.Parameter)]
    return any(torch_xla._XLAC._check_tensor_need_materialization(params)) if params else False


def _in_training(args: Sequence[Any]) -> bool:
    """An input other than a parameter requires grad: the caller differentiates through it.

    So a graph compiled without a backward (its forward ran under no_grad) is
    part of a training step: a checkpointed block, whose backward recomputes it.
    """
    return any(isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, torch.nn.Parameter) for a in args)


class DeferredForward(DeferredGraph):
    """A training forward embedded into the step; its parameters never carry a previous step's IR.

    Invariant: its outputs are computed once per call, in the step's one
    execution, or (after a read between forward and backward was seen) in an
    execution of their own right away.
    """

    unfused_effect = "it executes on its own; backward, accumulation and optimizer stay fused"

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], pair: _Pair) -> None:
        super().__init__(gm, example_inputs, BACKEND_NAME, validate=True)
        self.pair = pair

    def __call__(self, args: list) -> Any:
        if _pending_parameters(args):
            log.debug("parameters hold pending updates at a forward: syncing the previous step first")
            end_step()
        self.pair.check_uncut_step()
        return super().__call__(args)

    def _deferred(self, pending: list[torch.Tensor]) -> None:
        if self.pair.unfused_reason is not None:
            torch_xla._XLAC._xla_increment_counter(FORWARD_ALONE_COUNTER, 1)
            grad_sync.sync(pending, fresh=True)
            return
        _current_step()
        self.pair.launches_at_forward = _launches()
        self.pair.forward_outputs = [weakref.ref(t) for t in pending]


class StepBackward(DeferredBackward):
    """The backward of a fused step: deferred, synced by the step's cut, never at the end of the pass.

    It watches for reads between its forward and itself, and between itself
    and the step's cut (its step's closure); if one happened, the forward is
    switched to executing on its own from the next call on, with one warning.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], pair: _Pair) -> None:
        super().__init__(gm, example_inputs, BACKEND_NAME, sync_at_end=False, validate=True)
        self.pair = pair

    def __call__(self, args: list) -> Any:
        pair = self.pair
        if pair.forward_was_read():
            pair.unfuse("a value was read (an XLA execution ran) between its forward and backward")
        pair.launches_at_forward = None
        pair.forward_outputs = []
        outs = super().__call__(args)
        if pair.unfused_reason is None and pair.launches_at_backward is None:
            pair.launches_at_backward = _launches()
            _current_step().pairs[id(pair)] = pair
        return outs


class StepEndGraph(DeferredGraph):
    """A graph that needs no backward: an optimizer step joins the step and ends it; others join it.

    Invariant: a graph that updates its inputs in place (a compiled
    ``optimizer.step``) makes exactly one :func:`end_step` per call, after its
    own work is part of the pending step (fused) or before it runs (upstream
    path, so that upstream's own input sync finds nothing left to run). Any
    other such graph joins a pending step of this backend, or, with none
    pending, executes its own outputs (and nothing else) at once. One whose
    inputs carry autograd history opens the step (see :func:`_in_training`).
    """

    kind = "no-backward"
    unfused_effect = "the step is synced before it, and it executes on its own"

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], updates_inputs: bool) -> None:
        super().__init__(gm, example_inputs, BACKEND_NAME, validate=True)
        self.updates_inputs = updates_inputs

    def __call__(self, args: list) -> Any:
        if not self.updates_inputs and _in_training(args):
            _current_step()
        return super().__call__(args)

    def _deferred(self, pending: list[torch.Tensor]) -> None:
        if self.updates_inputs:
            end_step()
        elif not _open:
            grad_sync.sync(pending, fresh=True)

    def _run_upstream(self, args: list, reason: str) -> Any:
        end_step()
        return super()._run_upstream(args, reason)


def _updates_inputs() -> bool:
    """While AOTAutograd compiles an inference graph: whether it writes into one of its inputs.

    Such a graph is an optimizer step (it writes parameters and optimizer
    state) or another update of state (a cache's ``index_copy_``), which ends
    the step as upstream's execution would. Read from AOTAutograd's metadata
    for the graph being compiled; where that is unavailable, assume it does.
    """
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is None:
        return True
    return any(info.mutates_data for info in meta.input_info)


def compilers() -> dict[str, Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[[list], Any]]]:
    """The forward, backward and inference compilers for one AOTAutograd compilation."""
    _register_optimizer_hook()
    pair = _Pair()
    return dict(
        fw_compiler=lambda gm, example_inputs: DeferredForward(gm, example_inputs, pair),
        bw_compiler=lambda gm, example_inputs: StepBackward(gm, example_inputs, pair),
        inference_compiler=lambda gm, example_inputs: StepEndGraph(gm, example_inputs, _updates_inputs()),
    )
