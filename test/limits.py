"""One home for the tests' subprocess timeouts, and the runner of a script that reports in JSON.

A timeout here catches a hang, not a slow machine: ``HANG_TIMEOUT_S`` is
several times the longest any single subprocess of the suite takes on an idle
2-core machine (about 5 minutes: the patched pytorch/xla test file), so a busy
machine (measured: 3x slower) still passes, and a hang still fails the test.
"""

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

HANG_TIMEOUT_S = 1800


def run_json_script(script: "os.PathLike[str] | str", *args: str, env: "dict[str, str] | None" = None) -> Any:
    """Runs ``python script *args`` in a fresh process (PJRT CPU unless set) and returns its last stdout
    line parsed as JSON; fails the calling test, with the end of stderr, if the process dies."""
    import pytest

    full = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"), **(env or {}))
    script = pathlib.Path(script)
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=full,
        cwd=script.parent,
    )
    if proc.returncode != 0:
        pytest.fail(f"{script.name} {' '.join(args)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
