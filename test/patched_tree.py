"""Patched copies of installed packages, for the tests of the patches in upstream/.

Each such test copies an installed package (torch_xla, accelerate) to a
temporary folder, applies a patch to the copy there, and runs subprocesses
that import the copy first (``PYTHONPATH``): the installed environment itself
is never changed.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from limits import HANG_TIMEOUT_S

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A clean patch: no hunk needed an offset or fuzz to apply, and none failed.
UNCLEAN = r"offset|fuzz|FAILED"

# Runs a script the way `python script.py ARGS` would, after reporting which
# torch_xla it imports and (at exit) whether this project's package was loaded.
RUNNER = """
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


def copy_installed(
    tmp_path_factory: pytest.TempPathFactory, package: str, folder: str, tool: str, missing: str
) -> pathlib.Path:
    """A fresh temporary folder holding a copy of the installed ``package`` (no bytecode), to be patched by ``tool``.

    Skips the test, saying ``missing``, where ``tool`` (``patch``, ``git``) is not installed.
    """
    if shutil.which(tool) is None:
        pytest.skip(missing)
    root = tmp_path_factory.mktemp(folder)
    installed = pathlib.Path(importlib.util.find_spec(package).origin).parent
    shutil.copytree(installed, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def apply_cleanly(args: list[str], root: pathlib.Path, unclean: str = UNCLEAN) -> subprocess.CompletedProcess:
    """Runs the patch command ``args`` in ``root``; asserts it succeeded and said nothing matching ``unclean``."""
    proc = subprocess.run(args, cwd=root, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not re.search(unclean, out), out
    return proc


def run_with_path(
    args: list[str],
    pythonpath: str | pathlib.Path | None,
    cwd: pathlib.Path = ROOT,
    timeout: float = HANG_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Runs ``args`` on PJRT's CPU device with just ``pythonpath`` on ``PYTHONPATH`` (None: the installed packages)."""
    full_env = dict(os.environ, PJRT_DEVICE="CPU", **(env or {}))
    # Never the caller's PYTHONPATH: it could put another copy of a package first.
    full_env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        full_env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=full_env, timeout=timeout)


def run_script(
    script: pathlib.Path,
    pythonpath: pathlib.Path | None,
    *args: str,
    cwd: pathlib.Path = ROOT,
    timeout: float = HANG_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess, str]:
    """Runs ``script`` under :data:`RUNNER` with ``pythonpath`` first; returns the process and its stdout + stderr."""
    proc = run_with_path([sys.executable, "-c", RUNNER, str(script), *args], pythonpath, cwd, timeout, env)
    return proc, proc.stdout + proc.stderr
