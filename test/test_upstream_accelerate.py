"""The accelerate patch in upstream/accelerate/: applies to the installed accelerate, passes its tests,
and lets the frameworks' own switches take this project's backends.

The installed accelerate package is copied to a temporary folder, the patch (made against
accelerate's repository, `src/accelerate/...`) is applied there with `patch -p2`, and
everything runs in subprocesses that import the copy first (PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

from patched_tree import ROOT, apply_cleanly, copy_installed, run_with_path

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

PATCH = ROOT / "upstream" / "accelerate" / "0001-TorchDynamoPlugin-accept-registered-backends.patch"
UPSTREAM_TEST = ROOT / "upstream" / "accelerate" / "test_dynamo_backend_names.py"


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory) -> pathlib.Path:
    root = copy_installed(tmp_path_factory, "accelerate", "accelerate", "patch",
                          "GNU patch is not installed (apt-get install patch)")
    apply_cleanly(["patch", "-p2", "-i", str(PATCH)], root)
    which = run_with_path([sys.executable, "-c", "import accelerate; print(accelerate.__file__)"], root)
    assert which.stdout.strip() == str(root / "accelerate" / "__init__.py"), which.stdout + which.stderr
    return root


def test_upstream_test_fails_without_the_patch():
    # The test detects the bug: against the installed accelerate, every name outside the enum is rejected.
    proc = run_with_path([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(UPSTREAM_TEST)], None)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "5 failed, 1 passed" in proc.stdout, proc.stdout[-3000:]
    assert "is not a valid DynamoBackend" in proc.stdout


def test_upstream_test_passes_with_the_patch(patched_root):
    proc = run_with_path([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(UPSTREAM_TEST)], patched_root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "6 passed" in proc.stdout, proc.stdout[-3000:]


# Each example twice, 3 steps: compiled by the model (the supported way today) and by the
# framework's own switch; the second needs the patch. Prints the losses and the number of
# graphs dynamo compiled (a switch that compiled nothing would still train) as JSON.
_BOTH_WAYS = """
import importlib.util, json, os, sys
import torch._dynamo
from accelerate.state import AcceleratorState
from torch._dynamo.utils import counters
import torch_xla_bridge  # noqa: F401  (the checkout's backends; an installed package needs no import)

def load(name):
    spec = importlib.util.spec_from_file_location(name, f"examples/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

backend = sys.argv[1]
out = {}
for example in ("train_hf_trainer", "train_accelerate"):
    for way in ("model", "framework"):
        # One process, four trainings: accelerate keeps the first Accelerator's settings in a
        # process-wide state, and TrainingArguments(torch_compile_backend=...) sets
        # ACCELERATE_DYNAMO_BACKEND for the whole process; each run starts without either.
        AcceleratorState._reset_state(True)
        os.environ.pop("ACCELERATE_DYNAMO_BACKEND", None)
        torch._dynamo.reset()
        counters.clear()
        losses = load(example).main(["--backend", backend, "--steps", "3", "--compile-with", way])
        out[f"{example}/{way}"] = {"losses": losses, "graphs": counters["stats"]["unique_graphs"]}
print("RESULTS", json.dumps(out))
"""


def test_framework_switches_take_our_backend_with_the_patch(patched_root):
    proc = run_with_path([sys.executable, "-c", _BOTH_WAYS, "openxla_fused_step"], f"{patched_root}{os.pathsep}{ROOT}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1].splitlines()[0])
    for example in ("train_hf_trainer", "train_accelerate"):
        model, framework = results[f"{example}/model"], results[f"{example}/framework"]
        assert len(model["losses"]) == 3
        assert framework["losses"] == model["losses"], example
        assert framework["graphs"] == model["graphs"] > 0, (example, results)


def test_trainer_fsdpv2_compiled_by_its_own_switch_trains_with_trainers_losses(patched_root, tmp_path):
    """Trainer's xla_fsdp_v2 path (FSDPv2 per decoder layer by Trainer's auto-wrap policy, and around the model
    with Trainer's shard_output) with torch_compile_backend="openxla_fused_step", under SPMD on 4 devices:
    the uncompiled run's logged losses, nothing compiled after the first step (trainer_fsdpv2_checks.py)."""
    out = tmp_path / "result.json"
    proc = run_with_path([sys.executable, str(ROOT / "test" / "trainer_fsdpv2_checks.py"), str(out)],
                         f"{patched_root}{os.pathsep}{ROOT}", env={"CPU_NUM_DEVICES": "4"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    lazy, fused = result["uncompiled"], result["openxla_fused_step"]
    assert fused["wrapped"] == "OptimizedModule" and lazy["wrapped"] == "SpmdFullyShardedDataParallel"
    assert fused["layers_wrapped"] == lazy["layers_wrapped"] == 3  # 2 decoder layers + the model
    assert len(fused["losses"]) == 4 and fused["losses"] == lazy["losses"]
    assert fused["compiled"][1:] == [fused["compiled"][0]] * 3 and fused["compiled"][0][1] > 0
    # Per loop iteration, Trainer's own reads (logged loss, gradient norm) included: lazy SPMD 6; the fused step
    # the same 6 and two no-backward graphs before the step opens (causal mask, rotary cos/sin: docs/spmd.md).
    assert lazy["executions"][1:] == [6] * 3 and fused["executions"][1:] == [8] * 3
