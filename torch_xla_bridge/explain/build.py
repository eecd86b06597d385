"""From recorded events to a report: causes, step boundaries, metrics. Pure: no torch, no torch_xla.

:func:`build` folds an event list (:mod:`.events`) into an
:class:`~.report.ExecutionReport`; the recorder feeds the same
:class:`ReportBuilder` as it records, to know when ``steps=N`` is reached.

Where a step ends
-----------------
A step is complete once ``Optimizer.step`` returned (``OptimizerStepped``) or,
in a run that has not used a ``torch.optim`` optimizer, once a mark_step
returned. A step completed by its optimizer still takes the executions that
follow it (a trailing ``mark_step``, a ``loss.item()``) until the next step
opens: at the next forward, input sync or backward pass. Nothing made inside
an optimizer step (``CallStarted.in_optimizer``) opens or ends a step: dynamo
may split a compiled step into graphs with input syncs between them, and
``openxla_fused_step`` cuts at its start. A step that a ``mark_step`` ended
takes nothing more: any later execution opens the next
step. Work before the first backward pass or optimizer step (moving data, a
first sync) is part of step 1. After ``ManualSteps`` only ``StepMarked`` ends
a step.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from ..names import (
    COMPILE_COUNTERS,
    FOLD_COUNTER,
    FORWARD_ALONE_COUNTER,
    FRESH_STATE_COUNTER,
    INPUT_SYNC_COUNTER,
    OPTIMIZER_SYNC_COUNTER,
    REPLAY_CAPTURE_COUNTER,
    REPLAY_CHECK_COUNTER,
    REPLAY_COUNTER,
    REPLAY_PACK_COUNTER,
    REPLAY_RETRACE_CAUSES,
    REPLAY_UNPACK_COUNTER,
    STEP_COUNTER,
    SYNC_COUNTER,
    UNFOLDED_COUNTER,
)
from . import events as ev
from .report import FUSED_GRAD_SYNC, Cause, Execution, ExecutionReport, Step

# The counters a report sums over the run (report.metrics, besides ExecuteTime).
COUNTED = (
    INPUT_SYNC_COUNTER, SYNC_COUNTER, STEP_COUNTER, OPTIMIZER_SYNC_COUNTER, FORWARD_ALONE_COUNTER, FRESH_STATE_COUNTER,
    FOLD_COUNTER, UNFOLDED_COUNTER, *COMPILE_COUNTERS, REPLAY_COUNTER, REPLAY_CAPTURE_COUNTER, REPLAY_PACK_COUNTER,
    REPLAY_UNPACK_COUNTER, REPLAY_CHECK_COUNTER, *REPLAY_RETRACE_CAUSES,
)
# Causes whose execution opens a new step when the current one is complete.
_OPENING = {Cause.FORWARD, Cause.INPUT_SYNC}


def classify(call: ev.CallStarted) -> tuple[Cause, str]:
    """The cause of what a wrapped call executes, and a one-line detail, from the facts before it.

    The package's own syncs are recognized by the counter the core bumps
    right before each (``call.counters``), never by its function names.
    """
    cause, detail = _classify(call)
    signal = call.counters.get
    for counter, why in REPLAY_RETRACE_CAUSES.items():
        if signal(counter):
            detail += f"; a replayed step traced again: {why}"
    if signal(REPLAY_CAPTURE_COUNTER):
        detail += "; a replayed step's capture (traced once more, its program kept for the calls after)"
    return cause, detail


_REPLAY_CHECK = ("replayed step: its packed program run on the state before the capture call and compared with "
                 "the call's values, once at capture (unpacked if they differ)")


def _is_replay(call: ev.CallStarted) -> bool:
    return call.entry == ev.RUN_CACHED_GRAPH and bool(call.counters.get(REPLAY_COUNTER))


def _classify(call: ev.CallStarted) -> tuple[Cause, str]:
    signal = call.counters.get
    target = _target(call)
    if signal(REPLAY_CHECK_COUNTER):
        return Cause.OTHER, _REPLAY_CHECK
    if _is_replay(call):
        return (Cause.MARK_STEP, "replayed step: the captured step's program on this call's batch and state, "
                "one execution, nothing traced (forward, backward, optimizer)")
    if call.entry == ev.RUN_CACHED_GRAPH:
        if call.in_backward:
            return Cause.BACKWARD, "compiled backward graph (dynamo bridge)"
        if call.in_optimizer:
            return Cause.OPTIMIZER, "compiled optimizer step (dynamo bridge)"
        return Cause.FORWARD, "compiled graph (dynamo bridge)"
    if call.entry == ev.STEP_MARKER:
        if signal(REPLAY_PACK_COUNTER):
            return Cause.OTHER, "replayed step: the state it writes packed into flat buffers, once after its capture"
        if signal(REPLAY_UNPACK_COUNTER):
            return Cause.OTHER, "replayed step: its state unpacked from the flat buffers, once before it is traced again"
        if signal(STEP_COUNTER):
            return (
                Cause.MARK_STEP,
                "openxla_fused_step cuts the step: everything pending (forward, backward, "
                ".grad accumulation, optimizer) as one execution" + _accumulation(call.counters),
            )
        if signal(OPTIMIZER_SYNC_COUNTER):
            return (
                Cause.MARK_STEP,
                "openxla_fused_grad ends the step after the eager optimizer step: its update, its state "
                "and what ran on .grad since the backward, as one execution",
            )
        # Upstream's bridge syncs at the start of each compile; it has no counter for that.
        if call.in_upstream_bridge:
            return Cause.OTHER, "torch_xla.sync() by the dynamo bridge while it compiles a graph"
        return Cause.MARK_STEP, "xm.mark_step() / torch_xla.sync()"
    if signal(SYNC_COUNTER):
        return (
            Cause.BACKWARD,
            f"{FUSED_GRAD_SYNC}: {call.synced} tensors, one sync at "
            "the end of the backward pass (openxla_fused_grad)",
        )
    if signal(FRESH_STATE_COUNTER):
        return (
            Cause.OTHER,
            "openxla_fused_step materializes state still held as constants (new optimizer buffers, "
            "BatchNorm's counter), once, so the first step compiles the graph later steps reuse",
        )
    if signal(FORWARD_ALONE_COUNTER):
        return Cause.FORWARD, "forward executed on its own (openxla_fused_step unfused this graph after a value read)"
    # Upstream's bridge and ours (which syncs the same inputs first, without
    # buffer donation) both bump INPUT_SYNC_COUNTER right before the sync.
    from_bridge = bool(signal(INPUT_SYNC_COUNTER))
    if from_bridge and call.changed_grads:
        # The backward left them pending, then the user's code changed them:
        # a fused backward syncs them at its end, and they are pending again here.
        return (
            Cause.INPUT_SYNC,
            f"pending .grad of {_some(call.grads)}, changed in place after backward (clipped, scaled, ...), "
            f"synced by the dynamo bridge before the compiled {target}",
        )
    if from_bridge and call.grads:
        return (
            Cause.GRAD_ACCUMULATION,
            f"pending .grad of {_some(call.grads)} (AccumulateGrad's add) synced by the dynamo "
            f"bridge before the compiled {target}",
        )
    if from_bridge and call.in_backward:
        return (
            Cause.INPUT_SYNC,
            "the compiled backward's pending input (loss seed or incoming gradient) synced by the dynamo bridge",
        )
    if from_bridge:
        detail = f"{call.pending} pending inputs synced by the dynamo bridge before the compiled {target}"
        return Cause.INPUT_SYNC, detail
    if call.grads:
        return Cause.GRAD_READ, f"pending .grad of {_some(call.grads)} synced (_xla_sync_multi)"
    return Cause.OTHER, f"_xla_sync_multi of {call.synced} tensors"


def _accumulation(counters: dict[str, int]) -> str:
    """How the step's micro-batches were run, where it had several (from the counters since the last look)."""
    if counters.get(UNFOLDED_COUNTER):
        return "; its micro-batches not folded into one loop, each in the program (the warning says why)"
    if counters.get(FOLD_COUNTER):
        return "; its micro-batches folded into one loop (one forward and one backward in the program)"
    return ""


def _target(call: ev.CallStarted) -> str:
    return "backward" if call.in_backward else "optimizer step" if call.in_optimizer else "forward"


def _some(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    more = f", +{len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} leaves ({shown}{more})" if len(names) > 1 else shown


def _graph_info(e: Execution, x: ev.XlaExecution) -> Execution:
    e.graph_hash, e.inputs, e.outputs, e.torch_xla_cause = x.graph_hash, x.inputs, x.outputs, x.torch_xla_cause
    return e


def _gap_execution(x: ev.XlaExecution, materialized: list[str], alone: bool) -> Execution:
    """An execution outside entry points: a .grad read when it alone materialized a pending .grad."""
    if materialized and alone:
        cause = Cause.GRAD_READ
        detail = f"read of the pending .grad of {_some(materialized)} ran its accumulation"
    elif x.torch_xla_cause is not None and "access tensor value" in x.torch_xla_cause:
        cause, detail = Cause.VALUE_READ, "tensor value read on the host (.item(), .cpu(), printing, ...)"
    elif x.torch_xla_cause is None:
        cause = Cause.OTHER
        detail = (
            "not made through a wrapped entry point (most often a value read); "
            "torch_xla's execution analysis would say more (see the CLI)"
        )
    else:
        cause, detail = Cause.OTHER, f"torch_xla: {x.torch_xla_cause}"
    return _graph_info(Execution(cause, detail, "", x.frame), x)


class ReportBuilder:
    """Folds events, in order, into :attr:`report` (see the module docstring for step boundaries).

    ``report.steps`` holds the closed steps while events come in; the open
    one joins it at :class:`~.events.Finished`.
    """

    def __init__(self) -> None:
        self.report = ExecutionReport()
        self.finished = False
        self._step = Step(1)
        self._state = "open"  # "open", "optimizer" (an optimizer step returned), "sync" (a mark_step did)
        self._manual = False
        self._optimizer_seen = False
        self._call: Optional[tuple[ev.CallStarted, Cause, str]] = None  # the call in progress
        # Whether the last backward pass ran a compiled graph's backward. If not,
        # a pending .grad holds the whole lazy forward and backward, which no
        # backend's fused backward removes.
        self._compiled_backward = True
        self._counted = dict.fromkeys(COUNTED, 0)
        self._gave_up: list[ev.DynamoGaveUp] = []  # every give-up so far, carried into each new step

    @property
    def closed_steps(self) -> int:
        return len(self.report.steps)

    def add(self, event: ev.Event) -> None:
        if self.finished:
            raise ValueError(f"event after Finished: {event!r}")
        for name, n in getattr(event, "counters", {}).items():
            self._counted[name] = self._counted.get(name, 0) + n
        handler = getattr(self, "_on_" + type(event).__name__)
        handler(event)

    # --- events -----------------------------------------------------------------------

    def _on_OptimizerStepped(self, e: ev.OptimizerStepped) -> None:
        if self._step.optimizer_end is None:
            self._step.optimizer_end = len(self._step.executions)
        self._step.optimizer_steps += e.count
        self._optimizer_seen = True
        if not self._manual and self._state == "open":
            self._state = "optimizer"

    def _on_Gap(self, e: ev.Gap) -> None:
        # After a mark_step ended the step, these belong to the next one (in a
        # lazy loop a value read can be the first execution of a step).
        # A replayed step's check at its capture reads a value after the cut: still the capture's step.
        check = bool(e.counters.get(REPLAY_CHECK_COUNTER))
        if e.executions and not e.at_exit and self._state == "sync" and not self._manual and not check:
            self._close()
        alone = len(e.executions) == 1
        new = [_gap_execution(x, e.materialized, alone) for x in e.executions]
        for x in new if check else ():
            x.cause, x.detail = Cause.OTHER, _REPLAY_CHECK
        for x in new:
            if x.cause is Cause.GRAD_READ and not self._compiled_backward:
                x.cause = Cause.VALUE_READ
                x.detail = f"read of the .grad of {_some(e.materialized)}, computed lazily (no compiled backward)"
        self._step.executions += new

    def _on_CallStarted(self, e: ev.CallStarted) -> None:
        cause, detail = classify(e)
        self._call = (e, cause, detail)
        # Inside an optimizer step nothing opens the next step: dynamo may split a
        # compiled step into several graphs, with input syncs (and, under
        # openxla_fused_step, its cut) between them, all before its post-hook fires.
        opening = cause in _OPENING or (cause is Cause.MARK_STEP and self._state == "sync")
        # A replay is a whole step: it opens one after any step that ended; after a replay, so does the unpacking
        # of its state before the step is traced again.
        opening = opening or (_is_replay(e) and self._state != "open")
        opening = opening or bool(e.counters.get(REPLAY_UNPACK_COUNTER) and self._state == "sync")
        self._opening(opening and not e.in_optimizer)

    def _on_CallReturned(self, e: ev.CallReturned) -> None:
        if self._call is None or self._call[0].entry != e.entry:
            raise ValueError(f"{e.entry} returned without a matching CallStarted")
        call, cause, detail = self._call
        self._call = None
        if cause in (Cause.GRAD_ACCUMULATION, Cause.GRAD_READ) and not self._compiled_backward:
            cause = Cause.INPUT_SYNC
            detail = (
                f"pending .grad of {_some(call.grads)}, computed lazily (the backward pass ran no compiled "
                f"graph: forward and backward execute here), synced before the compiled {_target(call)}"
            )
        new = [
            _graph_info(
                Execution(
                    cause, detail, e.entry, call.frame, ir=call.ir, in_backward=call.in_backward,
                    in_optimizer=call.in_optimizer,
                ),
                x,
            )
            for x in e.executions
        ]
        cut = cause is Cause.MARK_STEP and bool(call.counters.get(STEP_COUNTER))
        if cut and e.materialized:
            # openxla_fused_step leaves .grad pending by design: its cut runs the
            # accumulation with the rest of the step, at no execution of its own.
            self._step.pending_grads = [n for n in self._step.pending_grads if n not in e.materialized]
            self._step.grads_in_cut += [n for n in e.materialized if n not in self._step.grads_in_cut]
        elif new and e.materialized and e.entry == ev.STEP_MARKER:
            # A sync of every live tensor: it ran the accumulation left pending.
            for x in new:
                x.detail += f"; it executed the pending .grad of {_some(e.materialized)}"
                if x.cause is Cause.OTHER:
                    x.cause = Cause.GRAD_ACCUMULATION
        self._step.executions += new
        self._step.replays += _is_replay(call)
        # A mark_step inside an optimizer step (openxla_fused_step's cut) is part of
        # that step, which its post-hook ends: it must not end the step itself.
        ends = self._state == "optimizer" or not self._optimizer_seen
        if cause is Cause.MARK_STEP and not self._manual and not call.in_optimizer and (ends or _is_replay(call)):
            self._state = "sync"

    def _on_BackwardStarted(self, e: ev.BackwardStarted) -> None:
        self._opening(True)
        self._compiled_backward = e.compiled

    def _on_BackwardEnded(self, e: ev.BackwardEnded) -> None:
        self._step.backward_passes += 1
        self._step.pending_grads += [n for n in e.pending_grads if n not in self._step.pending_grads]

    def _on_EqualLeaves(self, e: ev.EqualLeaves) -> None:
        self.report.equal_leaves = [list(g) for g in e.groups]

    def _on_DynamoGaveUp(self, e: ev.DynamoGaveUp) -> None:
        # Reported while dynamo compiles the call that failed its guards: after an ended step, that
        # call (a forward) opens the next step, which is the first to run the function eagerly.
        self._opening(True)
        self._gave_up.append(e)
        self._step.dynamo_gave_up.append(f"{e.function}: {e.limit}, last guard failure: {e.guard}")
        self._carry_gave_up(self._step)

    def _carry_gave_up(self, step: Step) -> None:
        step.dynamo_eager = [e.function for e in self._gave_up]
        step.eager_optimizer_step = any(e.optimizer for e in self._gave_up)

    def _on_ManualSteps(self, e: ev.ManualSteps) -> None:
        self._manual = True

    def _on_StepMarked(self, e: ev.StepMarked) -> None:
        self._manual = True
        self._close(force=True)

    def _on_Stopped(self, e: ev.Stopped) -> None:
        self.report.stopped_after = e.steps

    def _on_Finished(self, e: ev.Finished) -> None:
        step = self._step
        if step.executions or step.backward_passes or step.optimizer_steps:
            step.complete = self._state != "open" and not e.raised
            self.report.steps.append(step)
        self.report.metrics = {"ExecuteTime": e.execute_time, **self._counted}
        self.report.analysis = any(x.torch_xla_cause is not None for s in self.report.steps for x in s.executions)
        self.finished = True

    # --- step boundaries ----------------------------------------------------------

    def _opening(self, opening: bool) -> None:
        if opening and not self._manual and self._state != "open":
            self._close()

    def _close(self, force: bool = False) -> None:
        step, self._state = self._step, "open"
        if not (step.backward_passes or step.optimizer_steps or step.replays or (force and step.executions)):
            return  # set-up (data, a first sync): part of the next step
        self.report.steps.append(step)
        self._step = Step(step.number + 1)
        self._carry_gave_up(self._step)


def build(events: Iterable[ev.Event]) -> ExecutionReport:
    """The report of a complete recording (its last event is :class:`~.events.Finished`)."""
    builder = ReportBuilder()
    for event in events:
        builder.add(event)
    if not builder.finished:
        raise ValueError("the events end before Finished: not a complete recording")
    return builder.report
