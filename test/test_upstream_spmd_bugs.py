"""upstream/bugs' SPMD reproducers show their bugs on torch_xla 2.9.0; the mark_sharding patch fixes its bug.

For mark-sharding-under-dynamo.patch the installed torch_xla package is copied to
a temporary folder and patched there. The reproducers run in subprocesses (4 PJRT
CPU devices, SPMD) that import either the installed package or the patched copy,
never this project's.
"""

from __future__ import annotations

import pathlib
import re


from patched_tree import ROOT, apply_cleanly, copy_installed, run_script

PATCH = ROOT / "upstream" / "bugs" / "mark-sharding-under-dynamo.patch"
REPRODUCER = ROOT / "upstream" / "bugs" / "fsdpv2_compile_xlashardedtensor.py"


STALE_BACKWARD = ROOT / "upstream" / "bugs" / "spmd_checkpoint_stale_backward.py"


def _run(pythonpath: "pathlib.Path | None", script: pathlib.Path = REPRODUCER) -> tuple[int, str]:
    proc, out = run_script(script, pythonpath, cwd=pythonpath or ROOT, env={"CPU_NUM_DEVICES": "4"})
    assert "BRIDGE_IMPORTED False" in out, out[-3000:]
    return proc.returncode, out


def test_reproducer_shows_the_crash_on_torch_xla_2_9_0():
    rc, out = _run(None)
    assert rc == 1 and "BUG: mark_sharding cannot run under torch.compile" in out, out[-3000:]
    assert out.count("'XLAShardedTensor' object has no attribute '_local_tensor'") == 2, out[-3000:]


def test_patched_torch_xla_compiles_fsdpv2_with_openxla(tmp_path_factory):
    root = copy_installed(tmp_path_factory, "torch_xla", "torch_xla_mark_sharding", "patch",
                          "GNU patch is not installed (apt-get install patch)")
    apply_cleanly(["patch", "-p1", "-i", str(PATCH)], root)
    rc, out = _run(root)
    assert f"TORCH_XLA_FILE {root / 'torch_xla' / '__init__.py'}" in out, out[-3000:]
    assert rc == 0 and "ok: mark_sharding runs under torch.compile" in out, out[-3000:]
    assert out.count("runs, equal to lazy SPMD") == 2, out[-3000:]


def test_checkpointed_backward_reuses_the_first_batch_under_spmd_with_openxla():
    """Every backward after the first gives the first batch's gradients; all 5 inputs of the
    checkpointed backward (4 parameters, the batch) are bound as constants."""
    rc, out = _run(None, STALE_BACKWARD)
    assert rc == 1 and "BUG: openxla's checkpointed backward under SPMD reuses the first batch" in out, out[-3000:]
    rows = re.findall(r"^ +(\d) +(\S+) +(\S+) +(\S+)$", out, re.M)
    assert [r[0] for r in rows] == ["0", "1", "2"], out[-3000:]
    for step, own, first, lazy in rows:
        assert float(first) < 1e-6 and float(lazy) < 1e-6, out[-3000:]
        assert (float(own) < 1e-6) == (step == "0"), out[-3000:]
    assert "backward graph: [(16,), (16, 32), (32,), (32, 16), (8, 16)]" in out, out[-3000:]


PLACEHOLDER = ROOT / "upstream" / "bugs" / "spmd_placeholder_handle.py"


def test_reading_a_result_in_flight_under_spmd_crashes_torch_xla_2_9_0():
    """Both reads of a sharded placeholder's handle die with SIGSEGV (-11) in the reproducer's children."""
    rc, out = _run(None, PLACEHOLDER)
    assert rc == 1 and "BUG: reading a result in flight under SPMD crashes (handle, device_data_node)" in out, out[-3000:]
    assert re.search(r"handle +exit status +-11", out) and re.search(r"device_data_node +exit status +-11", out), out
