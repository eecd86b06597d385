"""SPMD data and parameter sharding on a 4-device PJRT CPU mesh.

SPMD must be on before the first device use and this process already uses XLA
without it, so the training runs happen in one subprocess (spmd_checks.py),
which also dumps the compiled HLO; the tests assert on what it reports.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from limits import HANG_TIMEOUT_S
from xla_helpers import FUSED, UPSTREAM

ROOT = Path(__file__).resolve().parent.parent
ATOL = 1e-5


def _run_spmd(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Runs ``script`` in a fresh process with SPMD's 4 PJRT CPU devices and this checkout first on the path."""
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        env=dict(
            os.environ,
            PJRT_DEVICE="CPU",
            CPU_NUM_DEVICES="4",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **env,
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def spmd(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("spmd")
    out, dump = tmp / "result.json", tmp / "hlo"
    _run_spmd(ROOT / "test" / "spmd_checks.py", str(out), XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text")
    result = json.loads(out.read_text())
    result["hlo_dir"] = str(dump)
    return result


def _state_err(run: dict, ref: dict) -> float:
    return max((torch.tensor(run["state"][k]) - torch.tensor(ref["state"][k])).abs().max().item() for k in ref["state"])


def test_runs_spmd_on_four_devices(spmd):
    assert spmd["spmd"] and spmd["devices"] == 4


@pytest.mark.parametrize("loop", ["dp", "dp_eager_opt", "fsdp"])
def test_fused_training_matches_eager_cpu(spmd, loop):
    run, cpu = spmd[loop][FUSED], spmd["cpu"]
    assert run["losses"] == pytest.approx(cpu["losses"], abs=ATOL)
    assert _state_err(run, cpu) < ATOL


def test_fused_first_step_matches_upstream(spmd):
    for loop in ("dp", "dp_eager_opt", "fsdp"):
        assert spmd[loop][FUSED]["losses"][0] == pytest.approx(spmd[loop][UPSTREAM]["losses"][0], abs=1e-6)


def test_grads_keep_their_parameters_sharding(spmd):
    run = spmd["fsdp"][FUSED]
    assert all(s.startswith("{devices=") for s in run["param_specs"]), run["param_specs"]
    assert run["grad_specs"] == run["param_specs"]
    dp = spmd["dp"][FUSED]
    assert dp["grad_specs"] == dp["param_specs"] == ["{replicated}"] * len(dp["param_specs"])


def test_executions_per_step(spmd):
    """Phases [forward, backward, optimizer] of every step after the warm-up.

    Eager optimizer + mark_step: ours 1+1+1, the floor; upstream 1+2+1 (the
    loss seed's sync + the backward). Compiled optimizer: AOTAutograd writes
    the optimizer's updated parameters (and momentum) back with ``copy_``,
    which under SPMD leaves them pending as a sharding annotation over the new
    data. Upstream's bridge syncs pending inputs of the next graph that reads
    them (the forward reads the parameters, the optimizer its momentum):
    2+2+2. Ours ends the optimizer step with a barrier where its update is
    pending, which syncs both in one execution: 1+1+2 (the graph, the barrier).
    """
    steady = lambda loop, backend: spmd[loop][backend]["phases"][2:]  # noqa: E731
    n = len(spmd["dp"][FUSED]["phases"]) - 2
    assert steady("dp_eager_opt", FUSED) == [[1, 1, 1]] * n
    assert steady("dp_eager_opt", UPSTREAM) == [[1, 2, 1]] * n
    for loop in ("dp", "fsdp"):
        assert steady(loop, FUSED) == [[1, 1, 2]] * n
        assert steady(loop, UPSTREAM) == [[2, 2, 2]] * n


def test_no_gradient_left_pending(spmd):
    for loop in ("dp", "dp_eager_opt", "fsdp"):
        assert spmd[loop][FUSED]["grads_pending"] == [0] * len(spmd[loop][FUSED]["phases"])
        assert spmd[loop][UPSTREAM]["grads_pending"][1:] == [6] * (len(spmd[loop][UPSTREAM]["phases"]) - 1)


def test_no_compile_after_warm_up(spmd):
    for loop in ("dp", "dp_eager_opt", "fsdp"):
        compiles = spmd[loop][FUSED]["uncached_compiles"]
        assert compiles[2:] == [compiles[2]] * (len(compiles) - 2)


def test_gradient_reduction_inside_the_backward_execution(spmd):
    """Every compiled program that embeds our backward holds the partitioner's collectives."""
    modules = [
        f
        for f in glob.glob(os.path.join(spmd["hlo_dir"], "*before_optimizations.txt"))
        if "FusedGrad" in Path(f).read_text()  # the LoweringContext name of our deferred graphs
    ]
    assert modules
    for f in modules:
        optimized = Path(f.replace("before_optimizations.txt", "cpu_after_optimizations.txt")).read_text()
        assert " all-reduce(" in optimized, f


def test_input_sharding_change_at_any_step(spmd):
    """Batch layout A for 7 steps (past upstream's 5-call check window), B for 3, A again."""
    ch = spmd["changes"]
    assert max(ch["grad_err"]) < ATOL
    assert ch["input_spec"][6] != ch["input_spec"][7] == ch["input_spec"][9]
    assert ch["input_spec"][10] == ch["input_spec"][0]
    compiles = ch["uncached_compiles"]
    assert compiles[1:7] == [compiles[0]] * 6  # layout A: compiled once
    assert compiles[7] > compiles[6]  # layout B: new programs
    assert compiles[8:] == [compiles[7]] * 4  # B again and A again: cache hits


def test_example_script_matches_spmd_without_compile():
    """examples/train_spmd.py with sharded parameters: same losses as plain SPMD LazyTensor."""
    runs = {}
    for backend in (FUSED, "eager"):
        proc = _run_spmd(ROOT / "examples" / "train_spmd.py", "--backend", backend, "--layout", "params", "--steps", "4")
        runs[backend] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs[FUSED]["devices"] == 4
    assert runs[FUSED]["losses"] == pytest.approx(runs["eager"]["losses"], abs=ATOL)
    assert runs[FUSED]["grads_keep_sharding"]


@pytest.mark.parametrize("user_value", [None, "7"])
def test_sharding_check_scope_nests_across_threads_and_restores_the_users_value(monkeypatch, user_value):
    """The scope that keeps upstream's input-sharding check from expiring: set while any call is
    inside it (nested, or on another thread), the user's own value (or its absence) back after."""
    import threading

    from torch_xla_bridge import dynamo_bridge

    env = dynamo_bridge._THRESHOLD_ENV
    if user_value is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, user_value)
    inside, leave = threading.Event(), threading.Event()
    seen: list = []

    def other_call() -> None:
        with dynamo_bridge.sharding_check_never_expires():
            inside.set()
            leave.wait(10)
            seen.append(os.environ.get(env))

    thread = threading.Thread(target=other_call)
    # This thread enters first and leaves first, while the other is still inside: a per-call
    # save and restore would put the user's value back under the other call's feet.
    with dynamo_bridge.sharding_check_never_expires():
        thread.start()
        assert inside.wait(10)
        with dynamo_bridge.sharding_check_never_expires():
            assert os.environ[env] == dynamo_bridge._NEVER
        assert os.environ[env] == dynamo_bridge._NEVER
    assert os.environ[env] == dynamo_bridge._NEVER
    leave.set()
    thread.join(10)
    assert seen == [dynamo_bridge._NEVER]
    assert os.environ.get(env) == user_value


def test_fold_reads_parameters_still_in_flight(spmd):
    """A result whose execution is launched and not finished: its buffer handle is read without a crash
    (torch_xla 2.9 segfaulted reading it under SPMD) and is the one it has once finished; fused steps right
    after the parameters' update fold as usual, with eager CPU's numbers."""
    run = spmd["in_flight"]
    assert run["key_checks_in_flight"] > 0 and run["same_keys"]
    assert run["folds"] == [2] * 3
    assert max(run["param_err"]) < ATOL
