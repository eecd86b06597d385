"""The data of an execution report: executions, steps, and the one-line verdict.

Pure data and arithmetic, no torch_xla: :mod:`.build` fills it from the events
the recorder (:mod:`torch_xla_bridge.explain.recorder`) captured, :mod:`.render`
prints it. Invariant: ``report.total`` (the rows) equals
``report.metrics["ExecuteTime"]``, torch_xla's own count of executions over the
same span, because every execution the recorder cannot attribute to an entry
point is still listed (as "value read", ".grad read" or "other").
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
from typing import Any, Optional


class Cause(str, enum.Enum):
    """Why an XLA execution ran."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    INPUT_SYNC = "input sync"
    GRAD_ACCUMULATION = "gradient accumulation"
    GRAD_READ = ".grad read"
    MARK_STEP = "mark_step"
    VALUE_READ = "value read"
    OTHER = "other"


# Causes that a fused backward removes, with the reason shown in the verdict.
AVOIDABLE: dict[Cause, str] = {
    Cause.INPUT_SYNC: "a compiled graph's input held pending IR (e.g. the loss seed of "
    "backward) and was executed on its own first",
    Cause.GRAD_ACCUMULATION: "AccumulateGrad left .grad as pending IR, executed on its own "
    "before the next compiled graph",
    Cause.GRAD_READ: "a read of .grad executed the accumulation AccumulateGrad left pending",
}
FIX = "backend='openxla_fused_grad' runs them inside the backward's execution"


_READS = (Cause.VALUE_READ, Cause.GRAD_READ)
_STEP_ENDS = (Cause.OPTIMIZER, Cause.MARK_STEP)
FUSED_GRAD, FUSED_STEP = "openxla_fused_grad", "openxla_fused_step"
# How build.classify's detail of openxla_fused_grad's end-of-backward sync begins.
FUSED_GRAD_SYNC = "deferred backward + .grad accumulation"


@dataclasses.dataclass
class Prediction:
    """What a backend would run for a step: ``low`` executions, exactly when ``estimate`` is empty.

    Otherwise between ``low`` and ``high``, for the reason ``estimate`` gives:
    the report never states a number it cannot derive from what ran.
    """

    backend: str
    low: int
    high: Optional[int]  # None: no upper bound known
    estimate: str = ""

    @property
    def exact(self) -> bool:
        return not self.estimate

    def __str__(self) -> str:
        if self.exact:
            return f"{self.backend} {self.low}"
        count = f">={self.low}" if self.high is None else f"{self.low}-{self.high}" if self.high != self.low else f"~{self.low}"
        return f"{self.backend} {count} (estimate: {self.estimate})"

    def to_dict(self) -> dict[str, Any]:
        return {"low": self.low, "high": self.high, "exact": self.exact, "estimate": self.estimate}


def predict(step: "Step") -> list[Prediction]:
    """What each fused backend would run for this step, derived from what it ran.

    ``openxla_fused_grad`` runs everything but the avoidable executions (its
    forward and optimizer graphs run as upstream's); after an eager optimizer
    step it ends the step there, so reads after it and a ``torch_xla.sync()``
    after it make that prediction a range. ``openxla_fused_step``
    runs the step as one execution (its cut), plus each read made before the
    optimizer step (or mark_step) ended, plus each forward such a read follows
    (it then executes that forward on its own); a read after the step ended is
    free, the cut materialized what it reads. Where dynamo split a compiled optimizer step
    into several graphs, whether that backend fuses them depends on the graphs
    (e.g. an optimizer's step counters kept on the CPU): that prediction is a
    range, from all fused to all run as upstream runs them (each after the cut),
    for ``openxla_fused_grad`` too (one dynamo graph that upstream splits around
    CPU ops is one execution there, with what was pending when the step began).
    Where dynamo gave up on a compiled optimizer step, the reads it makes inside
    it (its step counts, left on the device) are not predicted: both fused
    backends put those counts back on the host.
    A read that executed nothing in the explained run is not seen: under
    ``openxla_fused_grad`` (whose backward leaves nothing pending) that
    prediction is only a lower bound, and says so. A run under
    ``openxla_fused_step`` predicts nothing: its executions no longer show what
    the others would run separately.
    """
    if any(e.detail.startswith(FUSED_STEP) for e in step.executions):
        return []
    if step.optimizer_end is not None:
        end = step.optimizer_end
    else:
        ends = [i for i, e in enumerate(step.executions) if e.cause in _STEP_ENDS]
        end = ends[-1] if ends else len(step.executions)
    before = step.executions[:end]
    # Where dynamo gave up on a compiled optimizer step, the eager step reads its step counts, which
    # dynamo had moved onto the device, one execution each; both fused backends move them back to
    # the host when dynamo gives up (as an optimizer never compiled keeps them): no such read.
    counts_read = [step.eager_optimizer_step and e.in_optimizer and e.cause in _READS for e in before]
    reads = [i for i, e in enumerate(before) if e.cause in _READS and not counts_read[i]]
    # A read between a forward and the cut makes that backend execute the forward on its own.
    alone = sum(e.cause is Cause.FORWARD for e in before[: reads[-1]]) if reads else 0
    low = 1 + len(reads) + alone
    fused_step = Prediction(FUSED_STEP, low, low)
    if any(e.detail.startswith(FUSED_GRAD_SYNC) for e in step.executions):
        # Its backward left nothing pending: reads between forward and cut executed nothing here.
        fused_step = Prediction(
            FUSED_STEP, low, None,
            f"under {FUSED_GRAD} a read before the optimizer step executes nothing, so is not seen; "
            f"explain under openxla for an exact count",
        )
    fused_grad_total = step.total - len(step.avoidable) - sum(counts_read)
    fused_grad = Prediction(FUSED_GRAD, fused_grad_total, fused_grad_total)
    eager_optimizer = step.optimizer_end is not None and not any(e.cause is Cause.OPTIMIZER for e in step.executions)
    if eager_optimizer and not any(e.detail.startswith(FUSED_GRAD_SYNC) for e in step.executions):
        # That backend ends the step at an eager optimizer step (one execution, in place of the
        # input sync of the updated parameters at the next forward, or of a torch_xla.sync()
        # right after). A read after it is free if it reads what was pending then; lazy work
        # between it and a later torch_xla.sync() (an EMA) is one execution of its own.
        after = step.executions[step.optimizer_end :]
        # Without torch_xla's analysis a value read is an unattributed execution outside entry points.
        reads_after = sum(e.cause in _READS or (e.cause is Cause.OTHER and not e.entry) for e in after)
        sync_after = any(e.cause is Cause.MARK_STEP for e in after)
        if reads_after or sync_after:
            why = [f"{reads_after} read(s) after the eager optimizer step: free if what they read was pending "
                   f"at its end, where {FUSED_GRAD} ends the step"] if reads_after else []
            why += [f"lazy work between the optimizer step and torch_xla.sync() would be one execution more"] \
                if sync_after else []
            fused_grad = Prediction(
                FUSED_GRAD, fused_grad_total - reads_after, fused_grad_total + sync_after, "; ".join(why)
            )
    graphs = [i for i, e in enumerate(before) if e.cause is Cause.OPTIMIZER]
    if len(graphs) > 1:
        # Unfused, each graph runs as upstream ran it here, with the input syncs between
        # them; what was pending before the first (the .grad) the cut runs, before it.
        upstream = sum(
            e.in_optimizer and e.cause in (Cause.OPTIMIZER, Cause.INPUT_SYNC) for e in before[graphs[0] :]
        )
        # Upstream runs one dynamo graph with CPU ops (an optimizer's CPU step counts) as
        # several executions around them, which both fused backends run as one; separate
        # dynamo graphs (a graph break in the step) stay separate. A run cannot tell which.
        why = f"the compiled optimizer step ran as {len(graphs)} graphs"
        fused_step = Prediction(
            FUSED_STEP, low, None if fused_step.high is None else low + upstream,
            f"{why}, {low} if {FUSED_STEP} fuses them, {low + upstream} if it runs them unfused"
            + (f"; and {fused_step.estimate}" if fused_step.high is None else ""),
        )
        # Fused there, the one graph also runs what was pending at the optimizer step's start
        # (a lazily computed .grad) in its execution, as openxla_fused_step's cut does.
        first = next(i for i, e in enumerate(before) if e.in_optimizer)
        pieces = sum(
            e.in_optimizer and not e.avoidable and e.cause in (Cause.OPTIMIZER, Cause.INPUT_SYNC)
            for e in before[first:]
        )
        fused_grad = Prediction(
            FUSED_GRAD, fused_grad_total - (pieces - 1), fused_grad_total,
            f"{why}, {fused_grad_total - (pieces - 1)} if they are one dynamo graph split around CPU ops, "
            f"{fused_grad_total} if they are separate graphs",
        )
    return [fused_grad, fused_step]


def _predicted(step: "Step") -> str:
    predictions = predict(step)
    return f"; predicted per step: {', '.join(map(str, predictions))}" if predictions else ""


@dataclasses.dataclass
class Execution:
    """One XLA execution.

    ``graph_hash``, ``inputs`` and ``outputs`` come from torch_xla's execution
    analysis (``PT_XLA_DEBUG_LEVEL``) when it is on; without it, from the
    entry point's own arguments where it has them (``_run_cached_graph``), else None.
    """

    cause: Cause
    detail: str
    entry: str  # the torch_xla entry point that ran it, or "" for none intercepted
    frame: str  # the user's Python frame that triggered it ("" if unknown)
    graph_hash: Optional[str] = None
    inputs: Optional[int] = None
    outputs: Optional[int] = None
    torch_xla_cause: Optional[str] = None  # the analysis's own "Execution Cause"
    ir: Optional[str] = None  # pending IR of the synced tensors, where the recorder saw them
    in_backward: bool = False  # made inside an autograd engine pass
    in_optimizer: bool = False  # made below a frame in torch/optim (an optimizer step)

    @property
    def avoidable(self) -> bool:
        """Removed by ``openxla_fused_grad``: it keeps the forward's input sync (its forward is upstream's)."""
        return self.cause in AVOIDABLE and (self.cause is not Cause.INPUT_SYNC or self.in_backward)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cause"] = self.cause.value
        d["avoidable"] = self.avoidable
        return d


@dataclasses.dataclass
class Step:
    """The executions of one training step (see :mod:`.build` for where steps end)."""

    number: int
    executions: list[Execution] = dataclasses.field(default_factory=list)
    # Leaves whose .grad still held pending IR right after a backward pass (and cost an execution of their own).
    pending_grads: list[str] = dataclasses.field(default_factory=list)
    # Leaves whose pending .grad openxla_fused_step's cut executed with the rest of the step: its design, no fault.
    grads_in_cut: list[str] = dataclasses.field(default_factory=list)
    # Executions the step had made when its (first) optimizer step returned; None: no optimizer step.
    optimizer_end: Optional[int] = None
    backward_passes: int = 0
    optimizer_steps: int = 0
    # Replays of a captured step (replayed_step): the whole step, no backward pass or optimizer step traced.
    replays: int = 0
    complete: bool = True
    # Functions dynamo gave up compiling in this step (recompile_limit), as "function: limit, guard".
    dynamo_gave_up: list[str] = dataclasses.field(default_factory=list)
    # Functions dynamo had given up on by this step: they run eagerly wherever no compilation fits.
    dynamo_eager: list[str] = dataclasses.field(default_factory=list)
    # One of those is an optimizer step (its device step counts are read one by one where it runs eagerly).
    eager_optimizer_step: bool = False

    @property
    def total(self) -> int:
        return len(self.executions)

    @property
    def avoidable(self) -> list[Execution]:
        return [e for e in self.executions if e.avoidable]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.number,
            "complete": self.complete,
            "total": self.total,
            "avoidable": len(self.avoidable),
            "backward_passes": self.backward_passes,
            "optimizer_steps": self.optimizer_steps,
            "replays": self.replays,
            "pending_grads": list(self.pending_grads),
            "grads_in_cut": list(self.grads_in_cut),
            "optimizer_end": self.optimizer_end,
            "dynamo_gave_up": list(self.dynamo_gave_up),
            "dynamo_eager": list(self.dynamo_eager),
            "predicted": {p.backend: p.to_dict() for p in predict(self)},
            "executions": [e.to_dict() for e in self.executions],
        }


@dataclasses.dataclass
class ExecutionReport:
    """Every XLA execution of a run, per step, and torch_xla's metric deltas over the run."""

    steps: list[Step] = dataclasses.field(default_factory=list)
    metrics: dict[str, int] = dataclasses.field(default_factory=dict)
    analysis: bool = False  # torch_xla's execution analysis was read
    stopped_after: Optional[int] = None  # --steps N stopped the run
    # Leaves of the first backward that are separate tensors with equal, non-constant values
    # (weights tied on the CPU that model.to(device) untied), by group of names.
    equal_leaves: list[list[str]] = dataclasses.field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(s.total for s in self.steps)

    def complete_steps(self) -> list[Step]:
        return [s for s in self.steps if s.complete]

    def steady_steps(self) -> list[Step]:
        """The steps after the first (which compiles), or the only one."""
        steps = self.complete_steps()
        return steps[1:] if len(steps) > 1 else steps

    def verdict(self) -> str:
        """One line: executions per steady-state step and which of them are avoidable."""
        steady = self.steady_steps()
        if not steady:
            return f"no complete training step observed ({self.total} executions in all)"
        totals = sorted({s.total for s in steady})
        per_step = str(totals[0]) if len(totals) == 1 else f"{totals[0]}-{totals[-1]}"
        first, last = steady[0].number, steady[-1].number
        span = f"step {first}" if first == last else f"steps {first}-{last}"
        line = f"{per_step} executions per step ({span})"
        # The most common step stands for the steady state (the last of those: the last
        # step also holds whatever the script ran after training): its avoidable
        # executions, by cause, and the predictions.
        common = collections.Counter(s.total for s in steady).most_common()
        most = [total for total, n in common if n == common[0][1]]
        rep = [s for s in steady if s.total in most][-1]
        avoidable = collections.Counter(e.cause for e in rep.avoidable)
        if not avoidable:
            causes = ", ".join(e.cause.value for e in rep.executions) or "none"
            return f"{line}; none avoidable ({causes}){_predicted(rep)}"
        n = sum(avoidable.values())
        parts = ", ".join(
            f"{c.value} x{avoidable[c]}" if avoidable[c] > 1 else c.value
            for c in AVOIDABLE
            if c in avoidable
        )
        return f"{line}; {n} avoidable: {parts} ({FIX}){_predicted(rep)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_executions": self.total,
            "metrics": dict(self.metrics),
            "analysis": self.analysis,
            "stopped_after": self.stopped_after,
            "equal_leaves": [list(g) for g in self.equal_leaves],
            "verdict": self.verdict(),
            "steps": [s.to_dict() for s in self.steps],
        }

    def to_json(self, path: Optional[str] = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text
