"""torch_xla_bridge: the ``openxla_fused_grad`` and ``openxla_fused_step`` backends for ``torch.compile``.

``torch.compile(model, backend="openxla_fused_grad")`` trains like upstream
``openxla`` but runs the backward pass and the accumulation of every gradient
into ``.grad`` as one XLA execution. Importing this package registers the
backend; after ``pip install`` the ``torch_dynamo_backends`` entry point makes
the name resolvable without any import.
"""

from . import spmd_tracing
from .backend import openxla_fused_grad, openxla_fused_step, register
from .names import BACKEND_NAME, STEP_BACKEND_NAME
from .replay import replayed_step

__all__ = ["BACKEND_NAME", "STEP_BACKEND_NAME", "openxla_fused_grad", "openxla_fused_step", "register",
           "replayed_step"]
__version__ = "0.1.0"

register()
# xs.mark_sharding inside torch.compile (FSDPv2's forward): before the first trace, if torch_xla is loaded.
spmd_tracing.install_if_torch_xla_imported()
