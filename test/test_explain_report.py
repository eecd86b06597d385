"""The explain report as a pure function of recorded events: no XLA device, no torch_xla used here.

Each event list is what the recorder captures for a known loop (compare the
loops in test_explain.py, which run them under XLA).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from limits import HANG_TIMEOUT_S
from torch_xla_bridge.explain import events as ev
from torch_xla_bridge.explain.build import ReportBuilder, build, classify
from torch_xla_bridge.explain.render import format_text
from torch_xla_bridge.explain.report import FUSED_GRAD, FUSED_STEP, Cause, predict
from torch_xla_bridge.names import FORWARD_ALONE_COUNTER, INPUT_SYNC_COUNTER, STEP_COUNTER, SYNC_COUNTER

ROOT = Path(__file__).resolve().parent.parent
F_, B, O = Cause.FORWARD, Cause.BACKWARD, Cause.OPTIMIZER
VALUE_READ_CAUSE = "user code trying to access tensor value"


def call(entry: str, n: int = 1, counters: dict | None = None, materialized=(), **facts) -> list[ev.Event]:
    """A wrapped call that executed ``n`` times."""
    return [
        ev.CallStarted(entry, counters=dict(counters or {}), **facts),
        ev.CallReturned(entry, [ev.XlaExecution() for _ in range(n)], list(materialized)),
    ]


def forward() -> list[ev.Event]:
    return call(ev.RUN_CACHED_GRAPH, frame="train.py:10 in main")


def optimizer() -> list[ev.Event]:
    """A compiled optimizer step; the post-hook is seen at the next look, before the next call."""
    return call(ev.RUN_CACHED_GRAPH, in_optimizer=True) + [ev.OptimizerStepped()]


def fused_grad_step() -> list[ev.Event]:
    """openxla_fused_grad: forward, one end-of-backward sync (announced by its counter), optimizer."""
    backward = call(ev.SYNC_MULTI, counters={SYNC_COUNTER: 1}, in_backward=True, synced=8, pending=8, grads=["w", "b"])
    return forward() + [ev.BackwardStarted()] + backward + [ev.BackwardEnded([])] + optimizer()


def upstream_step() -> list[ev.Event]:
    """openxla, zero_grad(set_to_none=False): the loss seed and the pending .grad are synced on their own."""
    seed = call(ev.SYNC_MULTI, counters={INPUT_SYNC_COUNTER: 1}, in_backward=True, synced=1, pending=1, ir="seed")
    backward = call(ev.RUN_CACHED_GRAPH, in_backward=True)
    accumulation = call(
        ev.SYNC_MULTI, counters={INPUT_SYNC_COUNTER: 1}, in_optimizer=True, synced=2, pending=2, grads=["w", "b"],
        ir="aten::add",
    )
    return (
        forward() + [ev.BackwardStarted()] + seed + backward + [ev.BackwardEnded(["w", "b"])] + accumulation
        + optimizer()
    )


def finished(events: list[ev.Event], raised: bool = False) -> list[ev.Event]:
    total = sum(len(e.executions) for e in events if isinstance(e, (ev.Gap, ev.CallReturned)))
    return events + [ev.Gap(at_exit=True), ev.Finished(raised=raised, execute_time=total)]


def causes(step) -> list[Cause]:
    return [e.cause for e in step.executions]


def test_fused_grad_step_is_forward_backward_optimizer():
    report = build(finished(fused_grad_step() * 3))
    assert [causes(s) for s in report.steps] == [[F_, B, O]] * 3
    assert all(s.complete and s.backward_passes == 1 and s.optimizer_steps == 1 for s in report.steps)
    assert report.steps[0].executions[1].detail.startswith("deferred backward + .grad accumulation: 8 tensors")
    assert report.total == report.metrics["ExecuteTime"] == 9 and report.metrics[SYNC_COUNTER] == 3
    # Under openxla_fused_grad a read before the optimizer step executes nothing: fused_step's count is a bound.
    assert report.verdict() == (
        "3 executions per step (steps 2-3); none avoidable (forward, backward, optimizer); "
        "predicted per step: openxla_fused_grad 3, openxla_fused_step >=1 (estimate: under openxla_fused_grad "
        "a read before the optimizer step executes nothing, so is not seen; explain under openxla for an exact count)"
    )


def test_upstream_step_shows_input_sync_and_gradient_accumulation():
    report = build(finished(upstream_step() * 3))
    steady = report.steps[-1]
    assert causes(steady) == [F_, Cause.INPUT_SYNC, B, Cause.GRAD_ACCUMULATION, O]
    assert steady.pending_grads == ["w", "b"]
    accumulation = steady.executions[3]
    assert accumulation.detail.startswith("pending .grad of 2 leaves (w, b) (AccumulateGrad's add) synced")
    assert accumulation.detail.endswith("before the compiled optimizer step") and accumulation.ir == "aten::add"
    assert [e.avoidable for e in steady.executions] == [False, True, False, True, False]
    assert report.metrics[INPUT_SYNC_COUNTER] == 6
    assert report.verdict().startswith(
        "5 executions per step (steps 2-3); 2 avoidable: input sync, gradient accumulation"
    )
    assert report.verdict().endswith("predicted per step: openxla_fused_grad 3, openxla_fused_step 1")


def test_value_read_after_the_optimizer_stays_in_its_step():
    read = ev.Gap([ev.XlaExecution(torch_xla_cause=VALUE_READ_CAUSE, frame="train.py:12 in main")])
    report = build(finished((fused_grad_step() + [read]) * 2))
    assert [causes(s) for s in report.steps] == [[F_, B, O, Cause.VALUE_READ]] * 2
    assert report.steps[0].executions[-1].frame == "train.py:12 in main"


def lazy_iteration() -> list[ev.Event]:
    """No compile: loss.item() executes the forward, backward and an eager optimizer execute nothing, then mark_step."""
    return (
        [ev.Gap([ev.XlaExecution()]), ev.BackwardStarted(), ev.BackwardEnded(["w"]), ev.OptimizerStepped()]
        + call(ev.STEP_MARKER, materialized=["w"])
    )


def test_read_after_a_mark_step_opens_the_next_step():
    report = build(finished(lazy_iteration() * 3))
    assert [causes(s) for s in report.steps] == [[Cause.OTHER, Cause.MARK_STEP]] * 3
    assert report.steps[0].executions[1].detail.endswith("it executed the pending .grad of w")
    assert report.steps[-1].complete


def test_steps_n_stops_when_step_n_plus_1_opens():
    events = fused_grad_step() * 2 + forward()[:1]
    builder = ReportBuilder()
    closed = []
    for e in events:
        builder.add(e)
        closed.append(builder.closed_steps)
    # The recorder raises StopExplain once closed_steps reaches N: at the third forward, before it runs.
    assert closed.index(2) == len(events) - 1
    report = build(finished(events + [ev.Stopped(2)], raised=True))
    assert report.stopped_after == 2 and len(report.steps) == 2 and all(s.complete for s in report.steps)
    # A lazy loop stopped by its read: the read is kept, as an incomplete step.
    events = lazy_iteration() * 2 + [ev.Gap([ev.XlaExecution()]), ev.BackwardStarted(), ev.Stopped(2)]
    report = build(finished(events, raised=True))
    assert [causes(s) for s in report.steps] == [[Cause.OTHER, Cause.MARK_STEP]] * 2 + [[Cause.OTHER]]
    assert not report.steps[-1].complete


def test_manual_step_marks_are_the_only_boundaries():
    events = forward() + [ev.ManualSteps(), ev.StepMarked()] + fused_grad_step() + forward() + [ev.StepMarked()]
    report = build(finished(events + forward()))
    assert [causes(s) for s in report.steps] == [[F_], [F_, B, O, F_], [F_]]
    assert not report.steps[-1].complete  # no mark after it
    # Switching to manual marks after a mark_step ended a step: what ran since still joins that step.
    events = lazy_iteration() + [ev.ManualSteps(), ev.Gap([ev.XlaExecution()]), ev.StepMarked()]
    assert [causes(s) for s in build(finished(events)).steps] == [[Cause.OTHER, Cause.MARK_STEP, Cause.OTHER]]


def test_executions_seen_at_exit_join_the_last_step():
    events = lazy_iteration() + [ev.Gap([ev.XlaExecution()], at_exit=True), ev.Finished(execute_time=3)]
    (step,) = build(events).steps
    assert causes(step) == [Cause.OTHER, Cause.MARK_STEP, Cause.OTHER] and step.complete


def test_fused_step_cut_and_forward_on_its_own_are_told_by_counters():
    cut = call(ev.STEP_MARKER, counters={STEP_COUNTER: 1}, in_optimizer=True, in_upstream_bridge=True)
    eager_optimizer = [ev.BackwardStarted(), ev.BackwardEnded([]), ev.OptimizerStepped()]
    report = build(finished((forward() + eager_optimizer + cut) * 2))
    assert [causes(s) for s in report.steps] == [[F_, Cause.MARK_STEP]] * 2
    assert report.steps[-1].executions[1].detail.startswith("openxla_fused_step cuts the step")
    assert report.verdict() == "2 executions per step (step 2); none avoidable (forward, mark_step)"
    alone = ev.CallStarted(ev.SYNC_MULTI, counters={FORWARD_ALONE_COUNTER: 1}, synced=6, pending=6)
    cause, detail = classify(alone)
    assert cause is F_ and detail.startswith("forward executed on its own (openxla_fused_step unfused")


def split_compiled_adamw_step(cut: bool) -> list[ev.Event]:
    """A compiled AdamW step that dynamo split into two graphs, pending inputs synced between them.

    ``cut``: under openxla_fused_step, whose cut (in the optimizer step) runs the forward and backward first.
    """
    in_step = dict(in_optimizer=True, frame="train.py:20 in main")
    events = call(ev.STEP_MARKER, counters={STEP_COUNTER: 1}, **in_step) if cut else []
    return (
        events
        + call(ev.RUN_CACHED_GRAPH, **in_step)
        + call(ev.SYNC_MULTI, counters={INPUT_SYNC_COUNTER: 1}, synced=8, pending=6, **in_step)
        + call(ev.RUN_CACHED_GRAPH, **in_step)
        + [ev.OptimizerStepped()]
    )


@pytest.mark.parametrize("cut", [False, True], ids=["openxla", "openxla_fused_step"])
def test_a_split_compiled_optimizer_step_is_one_step(cut):
    """Nothing inside an optimizer step opens the next one, its input syncs and a cut included."""
    backward = [ev.BackwardStarted(), ev.BackwardEnded([])]
    iteration = ([] if cut else forward()) + backward + split_compiled_adamw_step(cut)
    report = build(finished(iteration * 5))
    assert len(report.steps) == 5 and all(s.complete and s.optimizer_steps == 1 for s in report.steps)
    calls = sum(isinstance(e, ev.CallReturned) for e in iteration)  # each executed once
    assert [s.total for s in report.steps] == [calls] * 5


@pytest.mark.parametrize(
    "call_, cause",
    [
        (ev.CallStarted(ev.RUN_CACHED_GRAPH), F_),
        (ev.CallStarted(ev.RUN_CACHED_GRAPH, in_backward=True, in_optimizer=True), B),
        (ev.CallStarted(ev.RUN_CACHED_GRAPH, in_optimizer=True), O),
        (ev.CallStarted(ev.STEP_MARKER), Cause.MARK_STEP),
        (ev.CallStarted(ev.STEP_MARKER, in_upstream_bridge=True), Cause.OTHER),
        (ev.CallStarted(ev.SYNC_MULTI, counters={SYNC_COUNTER: 1}, grads=["w"]), B),
        (ev.CallStarted(ev.SYNC_MULTI, counters={INPUT_SYNC_COUNTER: 1}, pending=1), Cause.INPUT_SYNC),
        (ev.CallStarted(ev.SYNC_MULTI, counters={INPUT_SYNC_COUNTER: 1}, grads=["w"]), Cause.GRAD_ACCUMULATION),
        (ev.CallStarted(ev.SYNC_MULTI, grads=["w"]), Cause.GRAD_READ),
        (ev.CallStarted(ev.SYNC_MULTI, synced=2), Cause.OTHER),
        # Only the core's counters say a sync is the core's: compile counters say nothing.
        (ev.CallStarted(ev.SYNC_MULTI, counters={"UncachedCompile": 1}, synced=2), Cause.OTHER),
    ],
)
def test_classify(call_, cause):
    assert classify(call_)[0] is cause


def test_executions_outside_entry_points():
    grad_read = ev.Gap([ev.XlaExecution()], materialized=["w"])
    two = ev.Gap([ev.XlaExecution(torch_xla_cause="some cause")] * 2, materialized=["w"])
    report = build(finished([grad_read, two]))
    (step,) = report.steps
    assert causes(step) == [Cause.GRAD_READ, Cause.OTHER, Cause.OTHER]
    assert step.executions[0].detail == "read of the pending .grad of w ran its accumulation"
    assert step.executions[1].detail == "torch_xla: some cause" and report.analysis
    assert not step.complete  # no backward, optimizer or mark_step ended it


def test_bridge_compile_sync_that_ran_a_pending_grad_is_gradient_accumulation():
    events = call(ev.STEP_MARKER, in_upstream_bridge=True, materialized=["w", "b"])
    (step,) = build(finished(events)).steps
    assert causes(step) == [Cause.GRAD_ACCUMULATION]
    assert step.executions[0].detail.endswith("; it executed the pending .grad of 2 leaves (w, b)")


GAVE_UP = ev.DynamoGaveUp("'step' (adam.py:213)", "recompile_limit=8", "betas[0] == 0.9", "openxla", optimizer=True)


def test_dynamo_give_up_labels_its_step_and_every_later_one():
    """The give-up comes while dynamo compiles the call that failed its guards: after an ended step, that
    call opens the next step, the first to run the function eagerly; later steps carry it as a fallback."""
    report = build(finished(fused_grad_step() + [GAVE_UP] + fused_grad_step() * 2))
    assert [len(s.dynamo_gave_up) for s in report.steps] == [0, 1, 0]
    assert "'step' (adam.py:213): recompile_limit=8, last guard failure: betas[0] == 0.9" == report.steps[1].dynamo_gave_up[0]
    assert [s.dynamo_eager for s in report.steps] == [[], ["'step' (adam.py:213)"], ["'step' (adam.py:213)"]]
    assert [s.eager_optimizer_step for s in report.steps] == [False, True, True]
    assert "dynamo stopped compiling 'step'" in format_text(report)
    assert "dynamo fallback: runs eagerly where no compilation fits: 'step'" in format_text(report)


def test_events_round_trip_through_json():
    events = finished(
        upstream_step() + [GAVE_UP] + lazy_iteration()
        + [ev.EqualLeaves([["wte", "head"]]), ev.ManualSteps(), ev.StepMarked(), ev.Stopped(1)],
        raised=True,
    )
    assert {type(e) for e in events} == set(ev.Event.__args__)  # every kind of event
    stored = json.loads(json.dumps(ev.to_dicts(events)))
    assert ev.from_dicts(stored) == events
    assert build(ev.from_dicts(stored)).to_dict() == build(events).to_dict()
    assert build(events).to_dict()["equal_leaves"] == [["wte", "head"]]


def test_incomplete_or_inconsistent_recordings_are_refused():
    with pytest.raises(ValueError, match="before Finished"):
        build(forward())
    with pytest.raises(ValueError, match="without a matching CallStarted"):
        build(forward()[1:])
    with pytest.raises(ValueError, match="after Finished"):
        build(finished([]) + forward())


def test_report_building_imports_neither_torch_nor_torch_xla():
    """events, build and report load with torch and torch_xla unimportable (and without the recorder)."""
    package = ROOT / "torch_xla_bridge"
    code = f"""
import sys, types
for blocked in ("torch", "torch_xla"):
    sys.modules[blocked] = None  # importing it now raises ImportError
# The packages' __init__ register the backends (torch): load their modules without them.
for name, path in (("torch_xla_bridge", {str(package)!r}), ("torch_xla_bridge.explain", {str(package / "explain")!r})):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
import torch_xla_bridge.explain.build
print(" ".join(sorted(m for m, module in sys.modules.items() if m.startswith("torch") and module is not None)))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [
        "torch_xla_bridge",
        "torch_xla_bridge.explain",
        "torch_xla_bridge.explain.build",
        "torch_xla_bridge.explain.events",
        "torch_xla_bridge.explain.report",
        "torch_xla_bridge.names",
    ]


def test_grad_syncs_no_fused_backward_removes_are_not_avoidable():
    """A .grad changed after backward (clipped), or computed lazily (no compiled graph in the pass)."""
    sync = dict(counters={INPUT_SYNC_COUNTER: 1}, in_optimizer=True, synced=2, pending=2, grads=["w", "b"])
    clipped = call(ev.SYNC_MULTI, changed_grads=["w", "b"], **sync)
    steps = [
        [ev.BackwardStarted(), ev.BackwardEnded(["w", "b"])] + call(ev.SYNC_MULTI, **sync),
        [ev.BackwardStarted(), ev.BackwardEnded(["w", "b"])] + clipped,
        [ev.BackwardStarted(compiled=False), ev.BackwardEnded(["w", "b"])] + call(ev.SYNC_MULTI, **sync),
    ]
    report = build(finished([e for s in steps for e in s + optimizer()]))
    syncs = [s.executions[0] for s in report.steps]
    assert [e.cause for e in syncs] == [Cause.GRAD_ACCUMULATION, Cause.INPUT_SYNC, Cause.INPUT_SYNC]
    assert [e.avoidable for e in syncs] == [True, False, False]
    assert "changed in place after backward" in syncs[1].detail and "computed lazily" in syncs[2].detail


def test_grad_executed_by_the_fused_step_cut_is_not_flagged():
    cut = call(ev.STEP_MARKER, counters={STEP_COUNTER: 1}, in_optimizer=True, materialized=["w"])
    user_sync = call(ev.STEP_MARKER, materialized=["w"])
    backward = [ev.BackwardStarted(), ev.BackwardEnded(["w", "b"])]
    fused_step, upstream = build(finished(backward + cut)).steps[0], build(finished(backward + user_sync)).steps[0]
    assert (fused_step.pending_grads, fused_step.grads_in_cut) == (["b"], ["w"])  # b's was not executed by it
    assert (upstream.pending_grads, upstream.grads_in_cut) == (["w", "b"], [])


def test_predictions_exact_or_labelled_estimate():
    read = ev.Gap([ev.XlaExecution(torch_xla_cause=VALUE_READ_CAUSE)])
    backward = [ev.BackwardStarted(), ev.BackwardEnded([])] + call(ev.RUN_CACHED_GRAPH, in_backward=True)

    def predicted(iteration):
        step = build(finished(iteration * 2)).steps[-1]
        return {p.backend: p for p in predict(step)}

    # A read between forward and optimizer step: that read, and the forward executed on its own.
    p = predicted(forward() + backward + [read] + optimizer())
    assert (p[FUSED_STEP].low, p[FUSED_STEP].exact, p[FUSED_GRAD].low) == (3, True, 4)
    # After the optimizer step a read is free.
    p = predicted(forward() + backward + optimizer() + [read])
    assert (p[FUSED_STEP].low, p[FUSED_STEP].exact) == (1, True)
    # A compiled optimizer step split into two graphs: from all fused to both run as here.
    p = predicted(forward() + backward + split_compiled_adamw_step(cut=False))
    assert (p[FUSED_STEP].low, p[FUSED_STEP].high) == (1, 4) and str(p[FUSED_STEP]).startswith(
        "openxla_fused_step 1-4 (estimate: the compiled optimizer step ran as 2 graphs"
    )
    # Under openxla_fused_grad reads before the optimizer step execute nothing: a lower bound.
    p = predicted(fused_grad_step())
    assert (p[FUSED_STEP].low, p[FUSED_STEP].high, p[FUSED_GRAD].exact) == (1, None, True)
    assert str(p[FUSED_STEP]).startswith("openxla_fused_step >=1 (estimate: ")
