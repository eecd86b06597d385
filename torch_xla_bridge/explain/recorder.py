"""Recording every XLA execution of a training run, with its cause.

How an execution is attributed
------------------------------
While an :class:`Explainer` is active it wraps the Python entry points through
which torch_xla's Python code makes executions happen:

- ``torch_xla._XLAC._run_cached_graph``: a graph compiled by the dynamo bridge.
  Inside an autograd engine pass (``torch._C._current_graph_task_id() >= 0``)
  it is the **backward**; called below ``torch/optim`` the **optimizer**; else
  the **forward**.
- ``torch_xla._XLAC._xla_sync_multi``: from ``openxla_fused_grad``'s
  end-of-backward callback, the **backward** (with the ``.grad`` accumulation);
  from the dynamo bridge's input check (``optimized_mod``, counter
  ``DynamoSyncInputExecuteTime``) a **gradient accumulation** when what it syncs
  is the pending ``.grad`` of a leaf the last backward fed, else an **input
  sync** (in a backward pass: the loss seed or an incoming gradient).
- ``torch_xla._XLAC._xla_step_marker`` (``xm.mark_step()``, ``torch_xla.sync()``):
  **mark_step**, or **other** when the dynamo bridge syncs while compiling.
- ``torch.autograd.backward`` (what ``Tensor.backward`` calls): not an
  execution itself; it records the leaves the pass accumulates into and, after
  the pass, which of their ``.grad`` still hold pending IR.

Around each wrapped call the recorder waits for the device
(``xm.wait_device_ops()``) and reads ``met.metric_data("ExecuteTime")`` (plus
``ExecuteReplicatedTime``, where SPMD records its executions): the
delta is the number of executions the call made. Executions between wrapped
calls (``.item()``, ``.cpu()``, printing a tensor: torch_xla's C++ runs them
with no Python entry point) are listed too, as **value read**, or **.grad read**
when a ``.grad`` left pending by backward got materialized by it, or **other**.
So the report's total always equals the ``ExecuteTime`` delta. When torch_xla's
execution analysis is on (:mod:`.analysis`), each execution gets torch_xla's
graph hash, input and output counts and cause, and the value reads their frame.

Waiting after every call makes the run synchronous: execution counts are exact,
step times are not representative while explaining.

Where a step ends
-----------------
A step is complete once ``Optimizer.step`` returned (a global optimizer step
post-hook; it also fires for an optimizer step compiled with
``torch.compile``) or, in a run that has not used a ``torch.optim`` optimizer, once
``xm.mark_step()``/``torch_xla.sync()`` returned. A step completed by its
optimizer still takes the executions that follow it (a trailing ``mark_step``, a
``loss.item()``) until the next step opens: at the next forward, input sync or
backward pass. A step that a ``mark_step`` ended takes nothing more: any later
execution opens the next step. Work before the first backward pass or optimizer
step (moving data, a first sync) is part of step 1. :meth:`Explainer.step`
marks boundaries by hand instead. ``steps=N`` stops the explained code (by
raising :class:`StopExplain`, a ``BaseException``) when step N+1 opens; what
step N+1 executed by then is kept as an incomplete step.
"""

from __future__ import annotations

import logging
import os
import sys
import types
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.optim.optimizer as optim_hooks
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch.utils.weak import WeakIdKeyDictionary

from .. import grad_sync
from . import analysis as xla_analysis
from .grad_graph import GradGraph, Names, accumulate_grad_leaves, autograd_graph, leaf_names
from .frames import first_user_frame, stack_files, user_frame
from .report import Cause, Execution, ExecutionReport, Step

log = logging.getLogger(__name__)

ENTRY_POINTS = ("_run_cached_graph", "_xla_sync_multi", "_xla_step_marker")
COUNTERS = ("DynamoSyncInputExecuteTime", grad_sync.SYNC_COUNTER, "UncachedCompile", "CachedCompile")
# Causes whose execution opens a new step when the current one is complete.
_OPENING = {Cause.FORWARD, Cause.INPUT_SYNC}
_OPTIM_DIR = os.sep + os.path.join("torch", "optim") + os.sep
_BRIDGE_FILE = os.path.join("torch_xla", "_dynamo", "dynamo_bridge.py")
_GRAD_SYNC_FILE = os.path.realpath(grad_sync.__file__)
# The openxla_fused_step backend's step cut and its unfused forward, by file and function.
_FUSED_STEP_FILE = os.path.join(os.path.dirname(_GRAD_SYNC_FILE), "fused_step.py")
_OUR_BRIDGE_FILE = os.path.join(os.path.dirname(_GRAD_SYNC_FILE), "dynamo_bridge.py")

_active: Optional["Explainer"] = None


class StopExplain(BaseException):
    """Raised into the explained code to stop it after the requested number of steps."""


def _execution_count() -> int:
    # Under SPMD every execution is a replicated one, recorded under its own metric.
    return sum((met.metric_data(m) or (0,))[0] for m in ("ExecuteTime", "ExecuteReplicatedTime"))


def _counters() -> dict[str, int]:
    return {c: met.counter_value(c) or 0 for c in COUNTERS}


def _needs_materialization(tensors: Sequence[torch.Tensor]) -> list[bool]:
    return list(torch_xla._XLAC._check_tensor_need_materialization(list(tensors))) if tensors else []


class Explainer:
    """Records executions while active (a context manager); the result is :attr:`report`.

    One at a time per process: the wrapped entry points are process-wide, and
    everything is unwrapped on exit, also when the explained code raises.
    """

    def __init__(
        self,
        steps: Optional[int] = None,
        names: Names = None,
        analysis_file: Optional[str] = None,
        graph: bool = False,
    ) -> None:
        if steps is not None and steps < 1:
            raise ValueError(f"steps must be a positive number of training steps, got {steps}")
        self.max_steps = steps
        self.names = names
        self.report = ExecutionReport()
        self.graph: Optional[GradGraph] = None  # the first backward pass's autograd graph, if asked
        self._want_graph = graph
        if analysis_file is None and xla_analysis.enabled():
            analysis_file = os.environ["PT_XLA_DEBUG_FILE"]
        self._analysis = xla_analysis.AnalysisLog(analysis_file) if analysis_file else None
        self._step = Step(1)
        self._state = "open"  # "open", "optimizer" (an optimizer step returned), "sync" (a mark_step did)
        self._manual = False
        self._optimizer_steps: list[int] = []  # appended to by the post-hook; see _poll_optimizer
        self._optimizer_seen = 0
        self._count = 0
        self._start_count = 0
        self._depth = 0
        self._counters: dict[str, int] = {}  # last seen value of each of COUNTERS
        self._counted: dict[str, int] = {}  # their increments while active
        self._leaf_names = WeakIdKeyDictionary()  # leaf -> name, for the leaves backward fed
        self._pending: list[tuple[str, weakref.ref]] = []  # .grad left pending by the last backward
        self._backward_frame = ""
        self._originals: dict[str, Callable] = {}
        self._hook: Any = None

    # --- activation ---------------------------------------------------------------

    def __enter__(self) -> "Explainer":
        global _active
        if _active is not None:
            raise RuntimeError("torch_xla_bridge.explain: an explainer is already active in this process")
        xm.wait_device_ops()
        self._count = _execution_count()
        self._start_count = self._count
        self._counters = _counters()
        self._counted = dict.fromkeys(COUNTERS, 0)
        if self._analysis is not None:
            self._analysis.read_new()  # skip what earlier executions wrote
        for name in ENTRY_POINTS:
            self._originals[name] = getattr(torch_xla._XLAC, name)
            setattr(torch_xla._XLAC, name, self._wrap(name, self._originals[name]))
        self._originals["backward"] = torch.autograd.backward
        torch.autograd.backward = self._wrap_backward(torch.autograd.backward)
        steps = self._optimizer_steps
        # Kept trivially traceable: under a compiled optimizer step dynamo replays the append.
        self._hook = optim_hooks.register_optimizer_step_post_hook(lambda opt, args, kwargs: steps.append(1))
        _active = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _active
        try:
            if self._depth == 0:
                self._poll_optimizer()
                self._flush_gap(may_open=False)
            if self._step.executions or self._step.backward_passes or self._step.optimizer_steps:
                self._step.complete = self._state != "open" and exc_type is None
                self.report.steps.append(self._step)
            self.report.metrics = {"ExecuteTime": self._count - self._start_count, **self._counted}
            self.report.analysis = any(e.torch_xla_cause is not None for s in self.report.steps for e in s.executions)
            if self._analysis is not None and self.report.total and not self.report.analysis:
                log.warning(
                    "torch_xla's execution analysis wrote nothing to %s: PT_XLA_DEBUG_LEVEL and "
                    "PT_XLA_DEBUG_FILE must be set before torch_xla first runs",
                    self._analysis.path,
                )
        finally:
            for name in ENTRY_POINTS:
                setattr(torch_xla._XLAC, name, self._originals[name])
            torch.autograd.backward = self._originals["backward"]
            self._hook.remove()
            _active = None
        return exc_type is not None and issubclass(exc_type, StopExplain)

    def step(self) -> None:
        """Ends the current step here; from now on only these calls end steps."""
        self._manual = True
        self._poll_optimizer()
        self._flush_gap()
        self._close_step(force=True)
        self._stop_if_done()

    # --- wrapping ---------------------------------------------------------------

    def _wrap(self, entry: str, original: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # nested in a wrapped call: counted by the outer one
                return original(*args, **kwargs)
            caller = sys._getframe(1)
            cause, detail, ir = self._classify(entry, args, kwargs, caller)
            self._enter(cause in _OPENING or (cause is Cause.MARK_STEP and self._state == "sync"))
            # The engine may run a backward node on a thread of its own, below no user frame.
            in_backward = torch._C._current_graph_task_id() >= 0
            frame = user_frame(caller) or (self._backward_frame if in_backward else "")
            self._depth += 1
            result = None
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
                self._record(entry, cause, detail, frame, ir, args, result, in_backward)
            if cause is Cause.MARK_STEP and not self._manual:
                self._poll_optimizer()
                if self._state == "optimizer" or not self._optimizer_seen:
                    self._state = "sync"
            return result

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _wrap_backward(self, original: Callable) -> Callable:
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return original(tensors, *args, **kwargs)
            self._enter(True)
            roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            roots = [r for r in roots if isinstance(r, torch.Tensor)]
            self._backward_frame = user_frame(sys._getframe(1))
            if self._want_graph and self.graph is None:
                self.graph = autograd_graph(roots, self.names)
            leaves = accumulate_grad_leaves(roots)
            result = original(tensors, *args, **kwargs)
            self._after_backward(leaves)
            return result

        backward.__wrapped__ = original  # type: ignore[attr-defined]
        return backward

    # --- classification -----------------------------------------------------------

    def _classify(
        self, entry: str, args: tuple, kwargs: dict, caller: types.FrameType
    ) -> tuple[Cause, str, Optional[str]]:
        files = list(stack_files(caller))
        in_backward = torch._C._current_graph_task_id() >= 0
        in_optimizer = any(_OPTIM_DIR in f for f, _ in files)
        target = "backward" if in_backward else "optimizer step" if in_optimizer else "forward"
        if entry == "_run_cached_graph":
            if in_backward:
                return Cause.BACKWARD, "compiled backward graph (dynamo bridge)", None
            if in_optimizer:
                return Cause.OPTIMIZER, "compiled optimizer step (dynamo bridge)", None
            return Cause.FORWARD, "compiled graph (dynamo bridge)", None
        if entry == "_xla_step_marker":
            if any(fn == "end_step" and os.path.realpath(f) == _FUSED_STEP_FILE for f, fn in files):
                return (
                    Cause.MARK_STEP,
                    "openxla_fused_step cuts the step: everything pending (forward, backward, "
                    ".grad accumulation, optimizer) as one execution",
                    None,
                )
            if any(f.endswith(_BRIDGE_FILE) for f, _ in files):
                return Cause.OTHER, "torch_xla.sync() by the dynamo bridge while it compiles a graph", None
            return Cause.MARK_STEP, "xm.mark_step() / torch_xla.sync()", None
        # _xla_sync_multi(tensors, devices, wait, sync_xla_data)
        tensors = list(args[0] if args else kwargs.get("tensors", []))
        if any(fn == "end_of_backward" and os.path.realpath(f) == _GRAD_SYNC_FILE for f, fn in files):
            return (
                Cause.BACKWARD,
                f"deferred backward + .grad accumulation: {len(tensors)} tensors, one sync at "
                "the end of the backward pass (openxla_fused_grad)",
                None,
            )
        if any(fn == "_deferred" and os.path.realpath(f) == _FUSED_STEP_FILE for f, fn in files):
            return (
                Cause.FORWARD,
                "forward executed on its own (openxla_fused_step unfused this graph after a value read)",
                None,
            )
        pending = [t for t, p in zip(tensors, _needs_materialization(tensors)) if p]
        ir = torch_xla._XLAC._get_xla_tensors_text(pending) if pending else None
        grads = self._grads_among(pending)
        # Upstream's bridge, or ours syncing the same inputs first (without buffer donation).
        from_bridge = any(
            (f.endswith(_BRIDGE_FILE) and fn == "optimized_mod")
            or (fn == "run_with_inputs_synced" and os.path.realpath(f) == _OUR_BRIDGE_FILE)
            for f, fn in files
        )
        if from_bridge and grads:
            return (
                Cause.GRAD_ACCUMULATION,
                f"pending .grad of {_some(grads)} (AccumulateGrad's add) synced by the dynamo "
                f"bridge before the compiled {target}",
                ir,
            )
        if from_bridge and in_backward:
            return (
                Cause.INPUT_SYNC,
                "the compiled backward's pending input (loss seed or incoming gradient) "
                "synced by the dynamo bridge",
                ir,
            )
        if from_bridge:
            return Cause.INPUT_SYNC, f"{len(pending)} pending inputs synced by the dynamo bridge before the compiled {target}", ir
        if grads:
            return Cause.GRAD_READ, f"pending .grad of {_some(grads)} synced (_xla_sync_multi)", ir
        return Cause.OTHER, f"_xla_sync_multi of {len(tensors)} tensors", ir

    def _grads_among(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Names of the leaves (fed by a recorded backward) whose ``.grad`` is among ``tensors``."""
        by_grad = {id(leaf.grad): name for leaf, name in self._leaf_names.items() if leaf.grad is not None}
        return [by_grad[id(t)] for t in tensors if id(t) in by_grad]

    # --- bookkeeping ----------------------------------------------------------------

    def _enter(self, opening: bool) -> None:
        """Before a wrapped call: list earlier unattributed executions, maybe start a step."""
        self._poll_optimizer()
        self._flush_gap()
        if opening and not self._manual and self._state != "open":
            self._close_step()
        self._stop_if_done()

    def _stop_if_done(self) -> None:
        if self.max_steps is not None and len(self.report.steps) >= self.max_steps:
            self.report.stopped_after = self.max_steps
            raise StopExplain(f"stopped after {self.max_steps} steps")

    def _poll_optimizer(self) -> None:
        if len(self._optimizer_steps) != self._optimizer_seen:
            self._step.optimizer_steps += len(self._optimizer_steps) - self._optimizer_seen
            self._optimizer_seen = len(self._optimizer_steps)
            if not self._manual and self._state == "open":
                self._state = "optimizer"

    def _close_step(self, force: bool = False) -> None:
        step, self._state = self._step, "open"
        if not (step.backward_passes or step.optimizer_steps or (force and step.executions)):
            return  # set-up (data, a first sync): part of the next step
        self.report.steps.append(step)
        self._step = Step(step.number + 1)

    def _new_executions(self) -> tuple[int, list[xla_analysis.AnalysisRecord]]:
        xm.wait_device_ops()
        n = _execution_count()
        k, self._count = n - self._count, n
        self._count_counters()
        records = self._analysis.read_new() if self._analysis is not None else []
        if records and len(records) != k:
            log.warning("execution analysis lists %d executions where ExecuteTime counted %d; not used", len(records), k)
            records = []
        return k, records

    def _count_counters(self) -> None:
        # The dynamo bridge clears all counters while it compiles (restoring only
        # its own), so increments are summed between reads; the counters of interest
        # are bumped right before a wrapped call, whose entry reads them.
        now = _counters()
        for c, v in now.items():
            last = self._counters.get(c, 0)
            self._counted[c] += v - last if v >= last else v
        self._counters = now

    def _record(
        self,
        entry: str,
        cause: Cause,
        detail: str,
        frame: str,
        ir: Optional[str],
        args: tuple,
        result: Any,
        in_backward: bool,
    ) -> None:
        k, records = self._new_executions()
        for j in range(k):
            rec = records[j] if records else None
            e = Execution(cause, detail, entry, frame, ir=ir, in_backward=in_backward)
            if rec is not None:
                e.graph_hash, e.inputs, e.outputs, e.torch_xla_cause = rec.graph_hash, rec.inputs, rec.outputs, rec.cause
            elif entry == "_run_cached_graph":
                e.graph_hash = args[0].hex() if isinstance(args[0], bytes) else str(args[0])
                e.inputs = len(args[1])
                e.outputs = len(result) if result is not None else None
            self._step.executions.append(e)
        materialized = self._refresh_pending()
        if k and materialized and entry == "_xla_step_marker":
            # A sync of every live tensor: it ran the accumulation left pending.
            note = f"; it executed the pending .grad of {_some(materialized)}"
            for e in self._step.executions[-k:]:
                e.detail += note
                if e.cause is Cause.OTHER:
                    e.cause = Cause.GRAD_ACCUMULATION

    def _flush_gap(self, may_open: bool = True) -> None:
        """Lists the executions no wrapped entry point made since the last look.

        After a step ended with a mark_step, they belong to the next step (in a
        lazy loop a value read can be the first execution of a step).
        """
        k, records = self._new_executions()
        if k and may_open and self._state == "sync" and not self._manual:
            self._close_step()
        materialized = self._refresh_pending() if k else []
        for j in range(k):
            rec = records[j] if records else None
            frame = first_user_frame(rec.frames) if rec is not None else ""
            if materialized and k == 1:
                cause = Cause.GRAD_READ
                detail = f"read of the pending .grad of {_some(materialized)} ran its accumulation"
            elif rec is not None and "access tensor value" in rec.cause:
                cause, detail = Cause.VALUE_READ, "tensor value read on the host (.item(), .cpu(), printing, ...)"
            else:
                cause = Cause.OTHER
                detail = (
                    "not made through a wrapped entry point (most often a value read); "
                    "torch_xla's execution analysis would say more (see the CLI)"
                    if rec is None
                    else f"torch_xla: {rec.cause}"
                )
            e = Execution(cause, detail, "", frame)
            if rec is not None:
                e.graph_hash, e.inputs, e.outputs, e.torch_xla_cause = rec.graph_hash, rec.inputs, rec.outputs, rec.cause
            self._step.executions.append(e)

    def _refresh_pending(self) -> list[str]:
        """Drops .grad tensors no longer pending from the watch list; returns their names."""
        alive = [(name, ref) for name, ref in self._pending if ref() is not None]
        flags = _needs_materialization([ref() for _, ref in alive])
        self._pending = [item for item, p in zip(alive, flags) if p]
        return [name for (name, _), p in zip(alive, flags) if not p]

    def _after_backward(self, leaves: list[torch.Tensor]) -> None:
        unknown = [leaf for leaf in leaves if leaf not in self._leaf_names]
        if unknown:
            for leaf, name in zip(unknown, leaf_names(unknown, self.names)):
                self._leaf_names[leaf] = name
        grads = [(self._leaf_names[l], l.grad) for l in leaves if l.grad is not None and l.grad.device.type == "xla"]
        flags = _needs_materialization([g for _, g in grads])
        pending = [(name, g) for (name, g), p in zip(grads, flags) if p]
        self._step.backward_passes += 1
        for name, _ in pending:
            if name not in self._step.pending_grads:
                self._step.pending_grads.append(name)
        self._pending = [(name, weakref.ref(g)) for name, g in pending]


def _some(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    more = f", +{len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} leaves ({shown}{more})" if len(names) > 1 else shown


def explain(
    steps: Optional[int] = None, names: Names = None, analysis_file: Optional[str] = None, graph: bool = False
) -> Explainer:
    """Context manager: ``with explain() as ex: ...`` then ``ex.report`` (see module docstring).

    ``steps``: stop the code inside after that many steps. ``names``: a module
    or name-to-tensor mapping naming the leaves. ``analysis_file``: torch_xla's
    ``PT_XLA_DEBUG_FILE`` to read (default: the environment's, when
    ``PT_XLA_DEBUG_LEVEL`` >= 1). ``graph``: keep the first backward pass's
    autograd graph as ``ex.graph``.
    """
    return Explainer(steps=steps, names=names, analysis_file=analysis_file, graph=graph)
