"""The backend name resolves after install with no import, and with an import; torch_xla missing is clear."""

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import torch._dynamo

from limits import HANG_TIMEOUT_S
import torch_xla_bridge
from xla_helpers import FUSED, FUSED_STEP


def run_python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=HANG_TIMEOUT_S
    )


def test_entry_point_declared():
    eps = entry_points(group="torch_dynamo_backends")
    assert FUSED in eps.names and FUSED_STEP in eps.names
    assert eps[FUSED].load() is torch_xla_bridge.openxla_fused_grad
    assert eps[FUSED_STEP].load() is torch_xla_bridge.openxla_fused_step


def test_listed_by_dynamo():
    assert {FUSED, FUSED_STEP} <= set(torch._dynamo.list_backends())


def test_unchanged_script_without_import():
    proc = run_python(
        """
        import sys
        import torch, torch_xla, torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met
        dev = torch_xla.device()
        model = torch.nn.Linear(4, 3).to(dev)
        compiled = torch.compile(model, backend="openxla_fused_grad")
        x = torch.randn(2, 4).to(dev)
        for _ in range(3):
            compiled(x).sum().backward()
        pending = torch_xla._XLAC._check_tensor_need_materialization([p.grad for p in model.parameters()])
        print("loaded-by-entry-point", "torch_xla_bridge" in sys.modules, "pending", any(pending))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "loaded-by-entry-point True pending False" in proc.stdout


def test_import_after_discovery_and_before():
    proc = run_python(
        """
        import torch._dynamo
        from torch._dynamo.backends.registry import lookup_backend
        names = torch._dynamo.list_backends()   # discovers the entry point first
        import torch_xla_bridge                  # must not clash with that
        torch_xla_bridge.register()              # idempotent
        assert lookup_backend("openxla_fused_grad") is torch_xla_bridge.openxla_fused_grad
        print("ok", "openxla_fused_grad" in names)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "ok True" in proc.stdout
    proc = run_python(
        """
        import torch_xla_bridge, torch._dynamo
        from torch._dynamo.backends.registry import lookup_backend
        assert "openxla_fused_grad" in torch._dynamo.list_backends()
        assert lookup_backend("openxla_fused_grad") is torch_xla_bridge.openxla_fused_grad
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr


def test_missing_torch_xla_is_an_import_error_with_the_install_command():
    proc = run_python(
        """
        import sys
        sys.modules["torch_xla"] = None   # as if torch_xla were not installed
        import torch
        import torch_xla_bridge           # importing and registering work without it
        compiled = torch.compile(torch.nn.Linear(4, 3), backend="openxla_fused_grad")
        try:
            compiled(torch.randn(2, 4))
        except Exception as e:  # dynamo wraps it in BackendCompilerFailed, quoting it
            print(type(e).__name__, e)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "ImportError: backend='openxla_fused_grad' needs torch_xla, which could not be imported" in proc.stdout
    assert "pip install torch_xla==2.9.0" in proc.stdout


def test_importing_the_package_leaves_torch_xla_unimported():
    """torch_xla reads its environment (PT_XLA_DEBUG_LEVEL, XLA_FLAGS, ...) when first imported:
    a script that imports this package first, then sets those, must still get its settings."""
    proc = run_python(
        """
        import sys
        import torch_xla_bridge, torch._dynamo
        assert {"openxla_fused_grad", "openxla_fused_step"} <= set(torch._dynamo.list_backends())
        print("torch_xla imported:", "torch_xla" in sys.modules)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "torch_xla imported: False" in proc.stdout
