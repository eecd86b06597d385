"""When dynamo gives up on part of a loop (test/fallback_loops.py): the step keeps its executions, against eager CPU.

Dynamo runs part of a compiled loop eagerly after ``recompile_limit`` (an
optimizer step whose float ``betas`` a scheduler rewrites, a model fed inputs of
varying length), in a block under ``torch._dynamo.disable``, and everywhere in a
model whose graph break it cannot resume. Each backend trains every loop in one
process; executions per iteration after warm-up and compilations are exact,
parameters and losses equal the loop's eager CPU run.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import pytest

import fallback_loops
from limits import run_json_script
from test_user_loops import assert_matches_eager_cpu_record
from xla_helpers import FUSED, FUSED_STEP

HERE = Path(__file__).parent

# Iterations before the counts below hold: the three compilations before dynamo gives up
# (recompile_limit 3), the first eager step's own compilation; the first pass over the lengths.
WARMUP = {
    "sequential_with_disabled_block": 2,
    "onecycle_compiled_adamw": 4,
    "varying_lengths": 6,
    "varying_lengths_compiled_optimizer": 6,
    "disabled_block": 2,
}
# The first iteration that runs the given-up function eagerly (recompile_limit 3: three compilations).
WARMUP_GIVE_UP = {"onecycle_compiled_adamw": 3, "varying_lengths": 3}
# Executions per iteration after warm-up. openxla_fused_step: the step, cut at the optimizer step,
# whatever dynamo runs eagerly. openxla_fused_grad: as with that part uncompiled: forward, backward
# with accumulation, the eager optimizer's step barrier (3); a forward dynamo runs eagerly leaves
# its whole step to the barrier (1); the disabled block's inputs are synced before the second graph.
EXECUTIONS: dict[str, dict[str, list[int]]] = {
    FUSED_STEP: {name: [1] * 12 for name in WARMUP},
    FUSED: {
        "sequential_with_disabled_block": [1] * 3,
        "onecycle_compiled_adamw": [3] * 5,
        "varying_lengths": [3, 3, 3, 1, 1, 1],
        "varying_lengths_compiled_optimizer": [3, 3, 3, 1, 1, 1],
        "disabled_block": [5] * 3,
    },
}


# XLA compilations per iteration after warm-up: none, but for openxla_fused_grad's
# - OneCycleLR loop: its second eager optimizer step compiles once more (its first read fresh state);
# - first length of the second pass: in the first pass its eager AdamW state was fresh constants
#   (zeros), now it is data (openxla_fused_step materializes fresh state before the first step).
COMPILES: dict[tuple[str, str], list[int]] = {
    (FUSED, "onecycle_compiled_adamw"): [1] + [0] * 11,
    (FUSED, "varying_lengths"): [1] + [0] * 11,
}


@functools.cache
def run_backend(backend: str) -> dict[str, Any]:
    return run_json_script(HERE / "fallback_loops.py", backend)


@functools.cache
def eager_cpu(name: str) -> dict[str, Any]:
    return fallback_loops.LOOPS[name](None, "cpu")


@pytest.mark.parametrize("backend", [FUSED_STEP, FUSED])
@pytest.mark.parametrize("name", list(WARMUP))
def test_step_keeps_its_executions_when_dynamo_runs_part_eagerly(name: str, backend: str) -> None:
    rec = run_backend(backend)[name]
    assert_matches_eager_cpu_record(rec, eager_cpu(name), rtol=1e-5, atol=1e-5)
    after = rec["executions"][WARMUP[name]:]
    assert after == EXECUTIONS[backend][name][: len(after)], rec["executions"]
    compiles = rec["compiles"][WARMUP[name]:]
    assert compiles == COMPILES.get((backend, name), [0] * 12)[: len(compiles)], rec["compiles"]
    assert not [w for w in rec["warnings"] if "was read" in w or "executed by something other" in w], rec["warnings"]


# What the one give-up warning of each loop names: the function, the guard that failed last, the fixes.
GAVE_UP_NAMES = {
    "onecycle_compiled_adamw": [
        "dynamo stopped compiling 'step'", "param_groups[0]['betas'][0] ==", "cycle_momentum=False", "lr=torch.tensor(",
    ],
    "varying_lengths": [
        "dynamo stopped compiling 'forward'", "size mismatch at index 1", "pad or bucket",
        "torch._dynamo.mark_dynamic(x, dim)",
    ],
}


@pytest.mark.parametrize("backend", [FUSED_STEP, FUSED])
@pytest.mark.parametrize("name", list(GAVE_UP_NAMES))
def test_what_dynamo_gave_up_on_is_named_with_its_fixes(name: str, backend: str) -> None:
    rec = run_backend(backend)[name]
    gave_up = [w for w in rec["warnings"] if "dynamo stopped compiling" in w]
    assert len(gave_up) == 1, rec["warnings"]
    assert gave_up[0].startswith(f"{backend}: "), gave_up[0]
    assert f"recompile_limit={fallback_loops.RECOMPILE_LIMIT}" in gave_up[0]
    for fragment in GAVE_UP_NAMES[name]:
        assert fragment in gave_up[0], fragment


def test_optimizer_step_dynamo_gave_up_on_reads_its_step_counts_on_the_host() -> None:
    # Dynamo moved the step counts onto the device when it compiled the step again; the eager
    # step reads them on the host, as an optimizer never compiled does (no execution per parameter).
    for backend in (FUSED_STEP, FUSED):
        assert run_backend(backend)["onecycle_compiled_adamw"]["step_devices"] == ["cpu"], backend


@functools.cache
def explained() -> dict[str, Any]:
    """Both loops of ``fallback_loops.EXPLAINED`` under torch_xla_bridge.explain, torch_xla's analysis on."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"PT_XLA_DEBUG_LEVEL": "2", "PT_XLA_DEBUG_FILE": str(Path(tmp) / "analysis.txt")}
        return run_json_script(HERE / "fallback_loops.py", "explain", env=env)


@pytest.mark.parametrize("name,function", [("onecycle_compiled_adamw", "'step'"), ("varying_lengths", "'forward'")])
def test_explain_labels_the_fallback_and_its_predictions_hold(name: str, function: str) -> None:
    """The step where dynamo gave up is labelled with the function and the guard, every later one as a
    fallback; from there on the predictions contain what each fused backend runs (test above)."""
    report = explained()[name]["report"]
    steps = report["steps"]
    first_eager = WARMUP_GIVE_UP[name]
    labelled = [s["step"] for s in steps if s["dynamo_gave_up"]]
    assert labelled == [first_eager + 1], labelled  # report steps count from 1
    assert function in steps[first_eager]["dynamo_gave_up"][0]
    assert f"recompile_limit={fallback_loops.RECOMPILE_LIMIT}" in steps[first_eager]["dynamo_gave_up"][0]
    for s in steps[:first_eager]:
        assert s["dynamo_eager"] == []
    for s in steps[first_eager:]:
        assert len(s["dynamo_eager"]) == 1 and function in s["dynamo_eager"][0]
    for backend in (FUSED_STEP, FUSED):
        measured = run_backend(backend)[name]["executions"][first_eager:]
        for s, actual in zip(steps[first_eager:], measured):
            p = s["predicted"][backend]
            assert p["low"] <= actual and (p["high"] is None or actual <= p["high"]), (s["step"], backend, p, actual)
            if backend == FUSED_STEP:
                assert p["exact"] or p["high"] is None, p  # exact where a read could not hide
