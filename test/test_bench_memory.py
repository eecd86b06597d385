"""bench.memory: device memory per program from torch_xla's post-compilation analysis, as the bench reports it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from bench import memory
from bench.models import by_name
from limits import HANG_TIMEOUT_S
from torch_xla_bridge.names import STEP_BACKEND_NAME, UPSTREAM_BACKEND_NAME

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The analysis prints GB with 6 decimals: each size is within half a unit of the true bytes.
GB_ROUNDING = 2**30 * 0.5e-6


def test_parse_reads_each_block_and_leaves_out_unknown_sizes():
    block = (
        "Post Compilation Analysis: ====\n"
        "Post Compilation Analysis: Graph input size: {a} GB\n"
        "Post Compilation Analysis: Graph output size: 0.000002 GB\n"
        "Post Compilation Analysis: Aliased Input size: 0.000001 GB\n"
        "Post Compilation Analysis: Intermediate tensor size: 0.000003 GB\n"
        "Post Compilation Analysis: Compiled program size: 0.000000 GB\n"
    )
    programs = memory.parse(block.format(a="0.000004") + block.format(a="Unknown") + block.format(a="1.000000"))
    assert programs == [
        memory.Program(argument=4295, output=2147, aliased=1074, temporary=3221),
        memory.Program(argument=2**30, output=2147, aliased=1074, temporary=3221),
    ]
    assert programs[0].own_bytes == 4295 + 2147 - 1074 + 3221
    assert memory.summary(programs)["device_peak_mb"] == programs[1].own_bytes / 2**20
    assert memory.summary([])["device_peak_mb"] is None


def _worker(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PT_XLA_DEBUG")}
    env["PJRT_DEVICE"] = "CPU"
    cfg = dict(workload="mlp2x64", mode=mode, loop="zero_grads", steps=2, warmup=2)
    proc = subprocess.run([sys.executable, "-m", "bench.worker", json.dumps(cfg)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_worker_reports_the_programs_memory_with_what_they_donate():
    param_bytes = sum(p.numel() * p.element_size() for p in by_name("mlp2x64").make_model().parameters())
    # LazyTensor's sync updates parameters and momentum buffers in place: XLA aliases (donates) both.
    lazy = _worker("lazy")
    assert abs(lazy["donated_mb"] * 2**20 - 2 * param_bytes) <= GB_ROUNDING, (lazy, param_bytes)
    # The fused step: one program (and one materializing the fresh momentum buffers); its outputs
    # hold the new parameters, .grad and momentum buffers. With a compiled optimizer it updates
    # parameters and momentum in place as LazyTensor does: both donated, so its peak is below
    # upstream's, which keeps the old and the new of both.
    fused = _worker(STEP_BACKEND_NAME)
    assert fused["programs_compiled"] == 2, fused
    assert fused["device_peak_mb"] * 2**20 >= 3 * param_bytes, (fused, param_bytes)
    assert abs(fused["donated_mb"] * 2**20 - 2 * param_bytes) <= GB_ROUNDING, (fused, param_bytes)
    upstream = _worker(UPSTREAM_BACKEND_NAME)
    assert upstream["donated_mb"] == 0, upstream
    assert fused["device_peak_mb"] < upstream["device_peak_mb"], (fused, upstream)
