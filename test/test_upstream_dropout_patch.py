"""upstream/0002: applies to torch_xla 2.9.0's files, and compiled ``openxla`` dropout then scales as eager CPU.

As for the 0001 patch (test_upstream_patch.py), the installed torch_xla package is
copied to a temporary folder and patched there; the reproducer and the patch's
upstream-style test run in subprocesses that import the patched copy.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from patched_tree import ROOT, apply_cleanly, copy_installed, run_script

PATCH = ROOT / "upstream" / "bugs" / "native-dropout-scale.patch"
REPRODUCER = ROOT / "upstream" / "bugs" / "native_dropout_scale.py"


def _run(script: pathlib.Path, pythonpath: pathlib.Path | None, *args: str) -> tuple[int, str]:
    proc, out = run_script(script, pythonpath, *args, cwd=pythonpath or ROOT)
    return proc.returncode, out


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory) -> pathlib.Path:
    root = copy_installed(tmp_path_factory, "torch_xla", "pytorch_xla_0002", "patch",
                          "GNU patch is not installed (apt-get install patch)")
    apply_cleanly(["patch", "-p1", "-i", str(PATCH)], root)
    return root


def test_reproducer_shows_the_bug_on_torch_xla_2_9_0():
    rc, out = _run(REPRODUCER, None)
    assert rc == 1 and "BUG: compiled dropout is scaled wrongly" in out, out[-3000:]
    # p=0.1: 10.0 instead of 1.111 forward, 11.11 backward.
    assert re.search(r"0\.1 +openxla +\S+ +10\.0000 +11\.1111", out), out[-3000:]


def test_patched_torch_xla_scales_compiled_dropout_as_eager_cpu(patched_root):
    rc, out = _run(REPRODUCER, patched_root)
    assert f"TORCH_XLA_FILE {patched_root / 'torch_xla' / '__init__.py'}" in out, out[-3000:]
    assert rc == 0 and "ok: compiled dropout scales as eager CPU" in out, out[-3000:]
    assert "Overriding a previously registered kernel" not in out


def test_upstream_style_test_passes_on_the_patched_copy(patched_root):
    rc, out = _run(patched_root / "test" / "dynamo" / "test_dynamo_dropout.py", patched_root, "-v")
    assert rc == 0 and re.search(r"^Ran 4 tests", out, re.M) and re.search(r"^OK$", out, re.M), out[-3000:]
