"""torch_xla_bridge: the ``openxla_fused_grad`` and ``openxla_fused_step`` backends for ``torch.compile``.

``torch.compile(model, backend="openxla_fused_grad")`` trains like upstream
``openxla`` but runs the backward pass and the accumulation of every gradient
into ``.grad`` as one XLA execution. Importing this package registers the
backend; after ``pip install`` the ``torch_dynamo_backends`` entry point makes
the name resolvable without any import.
"""

from typing import Any

from . import spmd_tracing
from .backend import openxla_fused_grad, openxla_fused_step, register
from .names import BACKEND_NAME, STEP_BACKEND_NAME

__all__ = ["BACKEND_NAME", "STEP_BACKEND_NAME", "openxla_fused_grad", "openxla_fused_step", "register",
           "replayed_step"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``replayed_step`` on first use: importing the package must not import torch_xla (a script's
    ``PT_XLA_DEBUG_LEVEL``, ``xr.use_spmd()`` come first), and replay.py needs it."""
    if name == "replayed_step":
        from .replay import replayed_step

        return replayed_step
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register()
# xs.mark_sharding inside torch.compile (FSDPv2's forward): before the first trace, if torch_xla is loaded.
spmd_tracing.install_if_torch_xla_imported()
