"""An exception inside a step leaves the process usable (test/exception_loops.py), against eager CPU.

Each backend runs every case in one process, a subprocess (a poisoned buffer
aborts it): a BatchNorm model trains four steps, the second raising at one point
of the step (forward, a gradient hook, between backward and optimizer, an
optimizer pre- or post-hook; optimizer eager or compiled), then a second model
trains three steps. Both models' parameters and BatchNorm statistics and every
loss equal the same loop's eager CPU run (the abandoned step's work executed whole
or dropped, as eagerly, never half of it); executions after the exception are
those of the same loop with no exception, compilations stay flat, and no warning
claims a read the loop did not make.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import exception_loops
from limits import run_json_script
from xla_helpers import FUSED, FUSED_STEP

HERE = Path(__file__).parent
FIRST_STEPS, SECOND_STEPS = 4, 3
ABANDONED = [name for name in exception_loops.CASES if "_optimizer" in name and not name.startswith("none/")]


@functools.cache
def run_backend(backend: str) -> dict[str, Any]:
    return run_json_script(HERE / "exception_loops.py", backend)


def _assert_close_values(got: Any, want: Any, path: str = "values") -> None:
    """Equal structure; numbers close (as eager CPU's to 1e-5); None (a step that raised) where eager has None."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            _assert_close_values(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close_values(g, w, f"{path}[{i}]")
    elif want is None:
        assert got is None, path
    else:
        assert got is not None, path
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5, msg=path)


@pytest.fixture(scope="module")
def eager_cpu() -> dict[str, Any]:
    return run_json_script(HERE / "exception_loops.py", "eager")


def _assert_like_eager_cpu(rec: dict[str, Any], ref: dict[str, Any]) -> None:
    _assert_close_values(rec["values"], ref["values"])
    _assert_close_values(rec["params"], ref["params"], "state")


@pytest.mark.parametrize("backend", [FUSED_STEP, FUSED])
@pytest.mark.parametrize("name", ABANDONED)
def test_training_goes_on_after_an_exception_in_a_step(name: str, backend: str, eager_cpu: dict[str, Any]) -> None:
    results = run_backend(backend)
    rec = results[name]
    _assert_like_eager_cpu(rec, eager_cpu[name])
    # The same loop without the exception: the step that raised executed nothing (its work joins
    # the next step, or is dropped with what referenced it); the next step runs that work with
    # its own (one execution more where the abandoned update was pending: its parameters are
    # synced before the forward); from then on, the first model and the second run as they do
    # in the loop without an exception.
    clean = results["none/" + name.split("/")[1]]
    raising = exception_loops.RAISING_STEP
    assert rec["executions"][raising + 2:] == clean["executions"][raising + 2:], rec["executions"]
    assert rec["executions"][raising + 1] <= clean["executions"][raising + 1] + 1, rec["executions"]
    # Compilations: the step after the exception may compile once (the abandoned step's
    # surviving work joins it: a graph of its own); none later, none for the second model.
    assert rec["compiles"][raising + 2:] == [0] * (FIRST_STEPS + SECOND_STEPS - raising - 2), rec["compiles"]
    assert rec["warnings"] == [], rec["warnings"]


@pytest.mark.parametrize("backend", [FUSED_STEP, FUSED])
def test_the_loop_without_an_exception_is_the_reference(backend: str, eager_cpu: dict[str, Any]) -> None:
    for name in ("none/eager_optimizer", "none/compiled_optimizer"):
        _assert_like_eager_cpu(run_backend(backend)[name], eager_cpu[name])


# Executions per call of a compiled function that runs forward and backward and returns the
# output, read each call, with no optimizer and no sync (pytorch/xla's own training test).
# openxla_fused_step: the read before the cut switches the forward to executing on its own; each
# later forward executes as the cut of the step the previous backward left pending (so nothing of
# it is donated under pending IR, and the step does not grow by a backward per call), then the
# read. openxla_fused_grad: forward, backward with accumulation (the engine callback), the read.
BACKWARD_INSIDE = {FUSED_STEP: 2, FUSED: 3}


@pytest.mark.parametrize("backend", [FUSED_STEP, FUSED])
def test_backward_inside_a_compiled_function_with_its_output_read(backend: str, eager_cpu: dict[str, Any]) -> None:
    rec = run_backend(backend)["backward_inside/read_output"]
    _assert_like_eager_cpu(rec, eager_cpu["backward_inside/read_output"])
    assert rec["executions"][1:] == [BACKWARD_INSIDE[backend]] * 4, rec["executions"]
    assert rec["compiles"][-1] == 0, rec["compiles"]


@pytest.mark.parametrize("backend", [FUSED_STEP, FUSED])
def test_a_step_abandoned_before_its_backward_draws_no_later_graph_in(
    backend: str, eager_cpu: dict[str, Any]
) -> None:
    """A compiled function of pending inputs, called after forwards that were never differentiated,
    executes at its call as in a fresh process: openxla_fused_step its output with its pending
    inputs (one execution), openxla_fused_grad as upstream (the input sync, then the graph)."""
    rec = run_backend(backend)["abandoned_forward/then_inference"]
    _assert_like_eager_cpu(rec, eager_cpu["abandoned_forward/then_inference"])
    assert rec["executed_at_call"] == {FUSED_STEP: 1, FUSED: 2}[backend]


def test_every_case_is_checked() -> None:
    checked = set(ABANDONED) | {"none/eager_optimizer", "none/compiled_optimizer"} | {
        "backward_inside/read_output", "abandoned_forward/then_inference"}
    assert checked == set(exception_loops.CASES)
