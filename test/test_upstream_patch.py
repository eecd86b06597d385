"""The pytorch/xla patch in upstream/: generated from this package, applies to torch_xla 2.9.0, passes its tests.

The installed torch_xla package is copied to a temporary folder (its compiled
``_XLAC`` module lives beside it in site-packages and stays importable), the
patch is applied there with GNU patch, and the upstream-style test file and
the measurement script run in subprocesses that import the patched copy.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / "upstream"

_spec = importlib.util.spec_from_file_location("make_patch", UPSTREAM / "make_patch.py")
make_patch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_patch)
PATCH = UPSTREAM / make_patch.PATCH_NAME

# Small enough for a 2-core CPU run; upstream's defaults are 224x224 images, batch 4, 10 samples.
UPSTREAM_TEST_ENV = {"BATCH_SIZE": "4", "SAMPLE_COUNT": "3", "IMAGE_SIZE": "64"}

# Runs a script the way `python script.py -v` would, after reporting which
# torch_xla it imports and (at exit) whether this project's package was loaded.
_RUNNER = """
import runpy, sys
import torch_xla
print("TORCH_XLA_FILE", torch_xla.__file__, flush=True)
path = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(path, run_name="__main__")
finally:
    print("BRIDGE_IMPORTED", "torch_xla_bridge" in sys.modules, flush=True)
"""


def _patch(root: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["patch", "-p1", *args, "-i", str(PATCH)], cwd=root, capture_output=True, text=True, timeout=60
    )


def _run_patched(root: pathlib.Path, script: pathlib.Path, *args: str, env: dict | None = None):
    full_env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(root), **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(script), *args],
        cwd=root, capture_output=True, text=True, env=full_env, timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert f"TORCH_XLA_FILE {root / 'torch_xla' / '__init__.py'}" in out, out[-3000:]
    assert "BRIDGE_IMPORTED False" in out, out[-3000:]
    return proc, out


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory) -> pathlib.Path:
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed (apt-get install patch); CI installs it")
    root = tmp_path_factory.mktemp("pytorch_xla")
    installed = pathlib.Path(importlib.util.find_spec("torch_xla").origin).parent
    shutil.copytree(installed, root / "torch_xla", ignore=shutil.ignore_patterns("__pycache__"))
    dry = _patch(root, "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert not (root / "torch_xla/_dynamo/deferred_backward.py").exists(), "--dry-run changed files"
    applied = _patch(root)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    # A clean patch: no hunk needed an offset or fuzz to apply.
    assert not re.search(r"offset|fuzz|FAILED", applied.stdout + applied.stderr), applied.stdout
    return root


def test_committed_patch_is_generated_from_the_package():
    assert make_patch.make_patch() == PATCH.read_text(), "stale: run python upstream/make_patch.py"


def test_patch_touches_the_bridge_config_and_adds_the_modules(patched_root):
    text = PATCH.read_text()
    files = re.findall(r"^diff --git a/(\S+) ", text, re.M)
    assert files == [
        "torch_xla/_dynamo/dynamo_bridge.py",
        "torch_xla/_dynamo/config.py",
        "torch_xla/_dynamo/grad_sync.py",
        "torch_xla/_dynamo/deferred_backward.py",
        "test/dynamo/test_dynamo_fused_grad.py",
    ]
    for rel in files:
        assert (patched_root / rel).is_file(), rel
    # The shared implementation: the patched module is the package's module with the listed edits.
    rel = "torch_xla/_dynamo/grad_sync.py"
    source, edits = make_patch.EDITS[rel]
    ours = (ROOT / "torch_xla_bridge" / source).read_text()
    theirs = (patched_root / rel).read_text()
    assert theirs == make_patch.apply_edits(ours, edits, rel)


def test_upstream_style_tests_pass_on_the_patched_copy(patched_root):
    test_file = patched_root / make_patch.TEST_FILE
    tree = ast.parse(test_file.read_text())
    expected = {
        f"{cls.name}.{fn.name}"
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")
    }
    assert len(expected) == 8
    proc, out = _run_patched(patched_root, test_file, "-v", env=UPSTREAM_TEST_ENV)
    assert proc.returncode == 0, out[-5000:]
    passed = set(re.findall(r"^(test_\w+) \(__main__\.(\w+)\.test_\w+\) \.\.\. .*?ok$", out, re.M | re.S))
    assert {f"{cls}.{name}" for name, cls in passed} == expected, out[-5000:]
    assert f"Ran {len(expected)} tests" in out
    assert re.search(r"^OK$", out, re.M)


def test_executions_per_step_on_the_patched_copy(patched_root):
    proc, out = _run_patched(patched_root, UPSTREAM / "measure.py")
    assert proc.returncode == 0, out[-5000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    results = report["results"]
    unfused_counts = {
        "set_to_none=True, compiled optimizer": 4,
        "set_to_none=False, compiled optimizer": 5,
        "eager optimizer + mark_step": 4,
    }
    assert set(results) == set(unfused_counts)
    for loop, unfused in unfused_counts.items():
        fused_run, unfused_run = results[loop]["fused"], results[loop]["unfused"]
        assert fused_run["executions_per_step"] == [3] * 4, loop
        assert unfused_run["executions_per_step"] == [unfused] * 4, loop
        assert fused_run["sync_input_executions_after_warmup"] == 0, loop
        assert unfused_run["sync_input_executions_after_warmup"] == 4 * (unfused - 3), loop
        assert fused_run["grad_pending_after_backward"] is False, loop
        # Same programs, same numbers.
        assert fused_run["losses"] == unfused_run["losses"], loop
    assert results["set_to_none=False, compiled optimizer"]["unfused"]["grad_pending_after_backward"] is True
