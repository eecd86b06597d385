"""Recording the raw facts of every XLA execution of a training run (:mod:`.events`).

The recorder only observes; :mod:`.build` attributes causes and cuts steps
(its docstring says where a step ends), from the event list alone.

What is recorded
----------------
While an :class:`Explainer` is active it wraps the Python entry points through
which torch_xla's Python code makes executions happen
(``torch_xla._XLAC._run_cached_graph``, ``_xla_sync_multi``,
``_xla_step_marker``) and ``torch.autograd.backward``, and registers a global
optimizer step post-hook (it also fires for an optimizer step compiled with
``torch.compile``). Before each wrapped call it records a ``CallStarted``:
whether it runs inside an autograd engine pass, below ``torch/optim`` or
below upstream's dynamo bridge, the user's frame, for a sync which tensors
held pending IR (and which of them are a ``.grad`` the last backward left
pending), and the increments of the counters the package's core bumps right
before each of its own syncs (:mod:`torch_xla_bridge.names`): the core
announces its syncs, no function name is looked for on the stack.

Around each wrapped call the recorder waits for the device and reads
:func:`torch_xla_bridge.counting.executions`: the delta is the number of
executions the call made. Executions between wrapped calls (``.item()``,
``.cpu()``, printing a tensor: torch_xla's C++ runs them with no Python entry
point) are recorded as a ``Gap``. So the report's total always equals the
executions torch_xla counted. When torch_xla's execution analysis is on
(:mod:`.analysis`), each execution gets torch_xla's graph hash, input and
output counts and cause, and the value reads their frame.

Waiting after every call makes the run synchronous: execution counts are
exact, step times are not representative while explaining. ``steps=N`` stops
the explained code (by raising :class:`StopExplain`, a ``BaseException``) when
step N+1 opens; what step N+1 executed by then is kept as an incomplete step.
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
from torch.utils.weak import WeakIdKeyDictionary

from .. import _private, counting, dynamo_fallback
from ..names import FORWARD_ALONE_COUNTER, SYNC_COUNTER
from . import analysis as xla_analysis
from . import events as ev
from .build import COUNTED, ReportBuilder
from .frames import first_user_frame, stack_files, user_frame
from .grad_graph import GradGraph, Names, autograd_graph, backward_nodes, leaf_names
from .report import ExecutionReport

log = logging.getLogger(__name__)

_OPTIM_DIR = os.sep + os.path.join("torch", "optim") + os.sep
# Upstream torch_xla's bridge syncs while it compiles, with no counter to say so: its file is the signal.
_BRIDGE_FILE = os.path.join("torch_xla", "_dynamo", "dynamo_bridge.py")
# Syncs the core announces with these counters: their IR (a whole fused backward's) is large and says nothing more.
_CORE_SYNCS = (SYNC_COUNTER, FORWARD_ALONE_COUNTER)

_active: Optional["Explainer"] = None


class StopExplain(BaseException):
    """Raised into the explained code to stop it after the requested number of steps."""


def _ir_hash(tensor: torch.Tensor) -> bytes:
    """torch_xla's hash of the pending IR graph of ``tensor``: it changes when an op is applied to it in place."""
    return bytes(torch_xla._XLAC._get_graph_hash([tensor]))


def _needs_materialization(tensors: Sequence[torch.Tensor]) -> list[bool]:
    return list(_private.need_materialization(list(tensors))) if tensors else []


def _equal_leaves(leaves: Sequence[torch.Tensor], names: Sequence[str]) -> list[list[str]]:
    """Names of XLA leaves that are separate tensors holding equal, non-constant values, in groups.

    Only leaves with a same-shaped, same-dtype twin are read, and only those
    that hold device data: copying device data to the host is a transfer, not an
    execution, so the report's counts stay exact (a pending leaf is skipped).
    """
    by_layout: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for leaf, name in zip(leaves, names):
        if leaf.device.type == "xla" and leaf.numel() > 1:
            by_layout.setdefault((tuple(leaf.shape), leaf.dtype), []).append((name, leaf))
    groups = []
    for same in by_layout.values():
        if len(same) < 2:
            continue
        ready = [(n, t) for (n, t), p in zip(same, _needs_materialization([t for _, t in same])) if not p]
        by_value: dict[bytes, list[str]] = {}
        for name, t in ready:
            host = t.detach().cpu()
            if bool((host == host.flatten()[0]).all()):
                continue  # a constant (LayerNorm's ones): equal by initialization, not by tying
            by_value.setdefault(host.contiguous().view(torch.uint8).numpy().tobytes(), []).append(name)
        groups += [g for g in by_value.values() if len(g) > 1]
    return groups


class _GaveUpFilter(logging.Filter):
    """Records a :class:`~.events.DynamoGaveUp` for dynamo's warning that it stops compiling a function
    (any backend); lets every record through."""

    def __init__(self, explainer: "Explainer") -> None:
        super().__init__()
        self.explainer = explainer

    def filter(self, record: logging.LogRecord) -> bool:
        g = dynamo_fallback.give_up_of(record)
        if g is not None:
            self.explainer._emit(
                ev.DynamoGaveUp(g.function, f"{g.limit}={g.value}", g.guard, g.backend, g.optimizer is not None)
            )
        return True


class Explainer:
    """Records events while active (a context manager): :attr:`events`, and :attr:`report` built from them.

    One at a time per process: the wrapped entry points are process-wide, and
    everything is unwrapped on exit, also when the explained code raises.
    Invariant: ``report`` is ``build.build(events)``, kept up to date as
    events come (closed steps during the run, the whole report after exit).
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
        self.events: list[ev.Event] = []
        self._builder = ReportBuilder()
        self.report: ExecutionReport = self._builder.report
        self.graph: Optional[GradGraph] = None  # the first backward pass's autograd graph, if asked
        self._want_graph = graph
        if analysis_file is None and xla_analysis.enabled():
            analysis_file = os.environ["PT_XLA_DEBUG_FILE"]
        self._analysis = xla_analysis.AnalysisLog(analysis_file) if analysis_file else None
        self._manual = False
        self._optimizer_steps: list[int] = []  # appended to by the post-hook; see _poll_optimizer
        self._optimizer_seen = 0
        self._count = 0  # executions counted at the last look
        self._start_count = 0
        self._depth = 0
        self._counters: dict[str, int] = {}  # value of each of COUNTED at the last look
        self._leaf_names = WeakIdKeyDictionary()  # leaf -> name, for the leaves backward fed
        # .grad left pending by the last backward: leaf name, the tensor, the hash of its pending IR then.
        self._pending: list[tuple[str, weakref.ref, bytes]] = []
        self._backward_frame = ""
        self._originals: dict[str, Callable] = {}
        self._hook: Any = None
        self._ties_checked = False
        self._gave_up = _GaveUpFilter(self)

    # --- activation ---------------------------------------------------------------

    def __enter__(self) -> "Explainer":
        global _active
        if _active is not None:
            raise RuntimeError("torch_xla_bridge.explain: an explainer is already active in this process")
        self._count = self._start_count = counting.executions()
        self._counters = {c: counting.counter(c) for c in COUNTED}
        if self._analysis is not None:
            self._analysis.read_new()  # skip what earlier executions wrote
        for name in ev.ENTRY_POINTS:
            self._originals[name] = getattr(torch_xla._XLAC, name)
            setattr(torch_xla._XLAC, name, self._wrap(name, self._originals[name]))
        self._originals["backward"] = torch.autograd.backward
        torch.autograd.backward = self._wrap_backward(torch.autograd.backward)
        steps = self._optimizer_steps
        # Kept trivially traceable: under a compiled optimizer step dynamo replays the append.
        self._hook = optim_hooks.register_optimizer_step_post_hook(lambda opt, args, kwargs: steps.append(1))
        logging.getLogger(_private.DYNAMO_FRAME_LOGGER).addFilter(self._gave_up)
        _active = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _active
        try:
            if self._depth == 0:
                self._poll_optimizer()
                self._emit_gap(at_exit=True)
            # torch_xla's own count over the span, read afresh: the report's rows must add up to it.
            self._emit(ev.Finished(raised=exc_type is not None, execute_time=counting.executions() - self._start_count))
            if self._analysis is not None and self.report.total and not self.report.analysis:
                log.warning(
                    "torch_xla's execution analysis wrote nothing to %s: PT_XLA_DEBUG_LEVEL and "
                    "PT_XLA_DEBUG_FILE must be set before torch_xla first runs",
                    self._analysis.path,
                )
        finally:
            for name in ev.ENTRY_POINTS:
                setattr(torch_xla._XLAC, name, self._originals[name])
            torch.autograd.backward = self._originals["backward"]
            self._hook.remove()
            logging.getLogger(_private.DYNAMO_FRAME_LOGGER).removeFilter(self._gave_up)
            _active = None
        return exc_type is not None and issubclass(exc_type, StopExplain)

    def step(self) -> None:
        """Ends the current step here; from now on only these calls end steps."""
        if not self._manual:
            self._manual = True
            self._emit(ev.ManualSteps())
        self._poll_optimizer()
        self._emit_gap()
        self._emit(ev.StepMarked())
        self._stop_if_done()

    # --- wrapping ---------------------------------------------------------------

    def _wrap(self, entry: str, original: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth:  # nested in a wrapped call: counted by the outer one
                return original(*args, **kwargs)
            self._poll_optimizer()
            counters = self._emit_gap(with_counters=False)
            call = self._call_facts(entry, args, kwargs, sys._getframe(1), counters)
            self._emit(call)
            self._stop_if_done()
            self._depth += 1
            result = None
            try:
                result = original(*args, **kwargs)
            finally:
                self._depth -= 1
                executions = self._executions_since(entry, args, result)
                counters = self._counter_increments()
                self._poll_optimizer()
                self._emit(ev.CallReturned(entry, executions, self._refresh_pending(), counters))
            return result

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _wrap_backward(self, original: Callable) -> Callable:
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return original(tensors, *args, **kwargs)
            self._poll_optimizer()
            self._emit_gap()
            self._backward_frame = user_frame(sys._getframe(1))
            roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            roots = [r for r in roots if isinstance(r, torch.Tensor)]
            leaves, compiled = backward_nodes(roots)
            self._emit(ev.BackwardStarted(self._backward_frame, compiled))
            self._stop_if_done()
            if not self._ties_checked:
                # Before the first update, while weights tied on the CPU and untied by .to() are still equal.
                self._ties_checked = True
                groups = _equal_leaves(leaves, self._names_of(leaves))
                if groups:
                    self._emit(ev.EqualLeaves(groups))
            if self._want_graph and self.graph is None:
                self.graph = autograd_graph(roots, self.names)
            result = original(tensors, *args, **kwargs)
            self._emit(ev.BackwardEnded(self._after_backward(leaves)))
            return result

        backward.__wrapped__ = original  # type: ignore[attr-defined]
        return backward

    # --- facts ------------------------------------------------------------------------

    def _call_facts(
        self, entry: str, args: tuple, kwargs: dict, caller: types.FrameType, counters: dict[str, int]
    ) -> ev.CallStarted:
        files = list(stack_files(caller))
        # The engine may run a backward node on a thread of its own, below no user frame.
        in_backward = _private.current_graph_task_id() >= 0
        call = ev.CallStarted(
            entry,
            counters=counters,
            in_backward=in_backward,
            in_optimizer=any(_OPTIM_DIR in f for f, _ in files),
            in_upstream_bridge=any(f.endswith(_BRIDGE_FILE) for f, _ in files),
            frame=user_frame(caller) or (self._backward_frame if in_backward else ""),
        )
        if entry == ev.SYNC_MULTI:  # _xla_sync_multi(tensors, devices, wait, sync_xla_data)
            tensors = list(args[0] if args else kwargs.get("tensors", []))
            pending = [t for t, p in zip(tensors, _needs_materialization(tensors)) if p]
            call.synced, call.pending = len(tensors), len(pending)
            call.grads = self._grads_among(pending)
            call.changed_grads = self._changed_grads(pending)
            if pending and not any(counters.get(c) for c in _CORE_SYNCS):
                call.ir = torch_xla._XLAC._get_xla_tensors_text(pending)
        return call

    def _grads_among(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Names of the leaves (fed by a recorded backward) whose ``.grad`` is among ``tensors``."""
        by_grad = {id(leaf.grad): name for leaf, name in self._leaf_names.items() if leaf.grad is not None}
        return [by_grad[id(t)] for t in tensors if id(t) in by_grad]

    def _changed_grads(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Leaves whose pending ``.grad`` among ``tensors`` is not as the last backward left it (clipped, scaled).

        Either the backward left it materialized (a fused backward syncs it) or
        its pending IR changed since: the user's code made it pending.
        """
        by_grad = {id(leaf.grad): name for leaf, name in self._leaf_names.items() if leaf.grad is not None}
        watched = {id(ref()): h for _, ref, h in self._pending if ref() is not None}
        return [
            by_grad[id(t)]
            for t in tensors
            if id(t) in by_grad and (id(t) not in watched or _ir_hash(t) != watched[id(t)])
        ]

    def _executions_since(self, entry: str = "", args: tuple = (), result: Any = None) -> list[ev.XlaExecution]:
        """One record per execution since the last look (waits for the device)."""
        n = counting.executions()
        k, self._count = n - self._count, n
        records = self._analysis.read_new() if self._analysis is not None else []
        if records and len(records) != k:
            log.warning(
                "execution analysis lists %d executions where ExecuteTime counted %d; not used", len(records), k
            )
            records = []
        if records:
            return [
                ev.XlaExecution(r.graph_hash, r.inputs, r.outputs, r.cause, first_user_frame(r.frames)) for r in records
            ]
        if entry == ev.RUN_CACHED_GRAPH:  # _run_cached_graph(graph_hash, graph_input)
            graph_hash = args[0].hex() if isinstance(args[0], bytes) else str(args[0])
            outputs = len(result) if result is not None else None
            return [ev.XlaExecution(graph_hash, len(args[1]), outputs) for _ in range(k)]
        return [ev.XlaExecution() for _ in range(k)]

    def _counter_increments(self) -> dict[str, int]:
        """Increments of COUNTED since the last look (only those that moved)."""
        now = {c: counting.counter(c) for c in COUNTED}
        increments = {}
        for c, v in now.items():
            last = self._counters.get(c, 0)
            # Upstream's dynamo bridge clears every counter while it compiles a
            # graph (metrics.clear_counters(), restoring only two of its own). A
            # counter below its last value restarted from zero since: its
            # increment is its new value, which becomes the baseline. After
            # clearing, the bridge syncs (a wrapped call: a look) before it bumps
            # a counter again, so a clear hidden by as many bumps as the old
            # value does not happen in its compile.
            d = v - last if v >= last else v
            if d:
                increments[c] = d
        self._counters = now
        return increments

    def _emit_gap(self, at_exit: bool = False, with_counters: bool = True) -> dict[str, int]:
        """Records what ran since the last look; returns the counter increments it did not record."""
        executions = self._executions_since()
        counters = self._counter_increments()
        materialized = self._refresh_pending() if executions else []
        kept = counters if with_counters else {}
        if executions or kept or at_exit:
            self._emit(ev.Gap(executions, materialized, kept, at_exit))
        return {} if with_counters else counters

    def _poll_optimizer(self) -> None:
        if len(self._optimizer_steps) != self._optimizer_seen:
            self._emit(ev.OptimizerStepped(len(self._optimizer_steps) - self._optimizer_seen))
            self._optimizer_seen = len(self._optimizer_steps)

    def _emit(self, event: ev.Event) -> None:
        self.events.append(event)
        self._builder.add(event)

    def _stop_if_done(self) -> None:
        if self.max_steps is not None and self._builder.closed_steps >= self.max_steps:
            self._emit(ev.Stopped(self.max_steps))
            raise StopExplain(f"stopped after {self.max_steps} steps")

    def _refresh_pending(self) -> list[str]:
        """Drops .grad tensors no longer pending from the watch list; returns their names."""
        alive = [item for item in self._pending if item[1]() is not None]
        flags = _needs_materialization([ref() for _, ref, _ in alive])
        self._pending = [item for item, p in zip(alive, flags) if p]
        return [name for (name, _, _), p in zip(alive, flags) if not p]

    def _names_of(self, leaves: list[torch.Tensor]) -> list[str]:
        """Each leaf's name (looked up once per leaf)."""
        unknown = [leaf for leaf in leaves if leaf not in self._leaf_names]
        if unknown:
            for leaf, name in zip(unknown, leaf_names(unknown, self.names)):
                self._leaf_names[leaf] = name
        return [self._leaf_names[leaf] for leaf in leaves]

    def _after_backward(self, leaves: list[torch.Tensor]) -> list[str]:
        """Watches the ``.grad`` the pass left pending; returns their leaves' names."""
        self._names_of(leaves)
        grads = [(self._leaf_names[l], l.grad) for l in leaves if l.grad is not None and l.grad.device.type == "xla"]
        flags = _needs_materialization([g for _, g in grads])
        pending = [(name, g) for (name, g), p in zip(grads, flags) if p]
        self._pending = [(name, weakref.ref(g), _ir_hash(g)) for name, g in pending]
        return [name for name, _ in pending]


def explain(
    steps: Optional[int] = None, names: Names = None, analysis_file: Optional[str] = None, graph: bool = False
) -> Explainer:
    """Context manager: ``with explain() as ex: ...`` then ``ex.report`` and ``ex.events`` (see module docstring).

    ``steps``: stop the code inside after that many steps. ``names``: a module
    or name-to-tensor mapping naming the leaves. ``analysis_file``: torch_xla's
    ``PT_XLA_DEBUG_FILE`` to read (default: the environment's, when
    ``PT_XLA_DEBUG_LEVEL`` >= 1). ``graph``: keep the first backward pass's
    autograd graph as ``ex.graph``.
    """
    return Explainer(steps=steps, names=names, analysis_file=analysis_file, graph=graph)
