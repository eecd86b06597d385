"""torch_xla's persistent compilation cache (``torch_xla.runtime.initialize_cache``) keeps the fused graphs.

The cache stores each compiled program under its graph hash and, at a
restart, loads the program of each hash it finds instead of compiling it. On
PJRT CPU torch_xla 2.9 cannot deserialize what it stored (counter
``PersistentCacheDeserializeFailure``, for upstream ``openxla`` too), so what
is tested here is the precondition a TPU user relies on: the same script in two
processes stores the same keys, one per compiled program, for both backends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from limits import HANG_TIMEOUT_S
from xla_helpers import FUSED, FUSED_STEP

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch_xla, torch_xla.runtime as xr
    xr.initialize_cache(sys.argv[2], readonly=False)
    import torch.nn as nn
    import torch_xla.debug.metrics as met
    import torch_xla_bridge  # noqa: F401
    torch.manual_seed(0)
    dev = torch_xla.device()
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward = torch.compile(model, backend=sys.argv[1])
    for i in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(i)).to(dev)
        forward(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    counters = {k: met.counter_value(k) for k in met.counter_names()}
    print(json.dumps(dict(keys=sorted(os.listdir(sys.argv[2])), counters=counters)))
    """
)


def _run(backend: str, cache: Path) -> dict:
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, backend, str(cache)],
        capture_output=True, text=True, timeout=HANG_TIMEOUT_S, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_two_processes_store_the_same_cache_keys(backend, tmp_path):
    first, second = _run(backend, tmp_path / "a"), _run(backend, tmp_path / "b")
    assert first["keys"] == second["keys"]
    # Every program compiled in the run is stored under its own key (none kept out of the cache).
    assert len(first["keys"]) == first["counters"]["UncachedCompile"] == first["counters"]["PersistentCacheMiss"]
    assert first["keys"]
