"""A Llama-shaped decoder trained as TPU users train it, compiled (examples/train_llama_spmd.py, issue 33).

One subprocess on 4 PJRT CPU devices runs the example (through bench/llama_spmd.py's
worker, which also reads XLA's memory analysis of every program), with one decoder layer
(compiling is most of the cost), on the 2-D mesh
(2, 2) ("fsdp", "model"): tensor-parallel attention and MLP weights, FSDPv2 for
the rest, bf16 autocast, 4 micro-batches, HF's non-reentrant gradient checkpointing,
eager AdamW with a cosine schedule; uncompiled lazy SPMD (without checkpointing, the
same math) is the reference. The tests assert on what it reports.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from test_spmd import ROOT, _run_spmd
from xla_helpers import FUSED, FUSED_STEP

STEPS, WARMUP, MICRO = 4, 2, 4
ATOL = 1e-5  # bf16 autocast, but the same ops in the same order: measured equal to lazy SPMD's losses


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("llama") / "result.json"
    _run_spmd(ROOT / "bench" / "llama_spmd.py", "--worker", "--mesh", "2d", "--modes",
              f"lazy,{FUSED},{FUSED_STEP}", "--steps", str(STEPS), "--out", str(out), "--layers", "1")
    return json.loads(out.read_text())


def test_runs_on_a_two_by_two_mesh(llama):
    for run in llama.values():
        assert run["devices"] == 4 and run["mesh"] == [2, 2]
    assert llama[FUSED_STEP]["args"]["accum"] == MICRO and llama[FUSED_STEP]["args"]["bf16"]
    assert llama[FUSED_STEP]["args"]["checkpoint"] and not llama["lazy"]["args"]["checkpoint"]
    lr = llama[FUSED_STEP]["lr"]  # the scheduler moves the eager optimizer's lr every step (warm-up, then cosine)
    assert all(a != b for a, b in zip(lr, lr[1:])), lr


@pytest.mark.parametrize("run", [FUSED, FUSED_STEP])
def test_losses_match_lazy_spmd(llama, run):
    assert llama[run]["losses"] == pytest.approx(llama["lazy"]["losses"], abs=ATOL)


def test_executions_per_optimizer_step(llama):
    """Lazy SPMD and the fused step: the whole step (4 micro-batches, AdamW) is one execution after the warm-up.
    openxla_fused_grad: forward and backward + accumulation per micro-batch, then the optimizer."""
    assert llama["lazy"]["executions"] == [1] * STEPS
    assert llama[FUSED_STEP]["executions"][WARMUP:] == [1] * (STEPS - WARMUP)
    assert llama[FUSED]["executions"][WARMUP:] == [2 * MICRO + 1] * (STEPS - WARMUP)


@pytest.mark.parametrize("run", ["lazy", FUSED, FUSED_STEP])
def test_nothing_compiles_after_warm_up(llama, run):
    """Neither XLA programs (CompileTime) nor dynamo frames, though the lr changes every step."""
    compiled = llama[run]["compiled"]
    assert compiled[WARMUP - 1:] == [compiled[WARMUP - 1]] * (STEPS - WARMUP + 1)


def test_fused_step_holds_the_state_per_device_that_lazy_spmd_holds(llama):
    """The whole-step program donates the parameters and AdamW's moments, each a per-device shard as in
    lazy SPMD's program: the same donated bytes (the moments came out replicated, 2.4x that, before the
    fused step gave fresh state its parameter's sharding)."""
    assert llama[FUSED_STEP]["donated_mb"] == llama["lazy"]["donated_mb"] > 0
