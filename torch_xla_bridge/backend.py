"""Registration of ``openxla_fused_grad`` and its AOTAutograd wiring.

The backend is upstream ``openxla`` with a backward compiler of our own: the
forward runs through torch_xla's dynamo bridge unchanged, the backward is
deferred (see :mod:`torch_xla_bridge.dynamo_bridge`) and synced together with
the gradient accumulation by one autograd engine callback (see
:mod:`torch_xla_bridge.grad_sync`). Both backends trace their graphs with
:mod:`torch_xla_bridge.decompositions`, which replaces ops whose torch_xla
lowering disagrees with eager PyTorch (dropout's scale, BatchNorm's running
variance).

This module imports only torch, so that dynamo can list the backend (and the
entry point can load it) on a machine without torch_xla; torch_xla is imported
when a graph is compiled.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable, Sequence

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import register_backend

from . import decompositions

log = logging.getLogger(__name__)

BACKEND_NAME = "openxla_fused_grad"
STEP_BACKEND_NAME = "openxla_fused_step"
TORCH_XLA_INSTALL = "pip install torch_xla==2.9.0"


def require_torch_xla(backend: str = BACKEND_NAME) -> None:
    """Raises an ImportError naming the install command if torch_xla is missing."""
    try:
        import torch_xla  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"backend={backend!r} needs torch_xla, which could not be imported "
            f"({e}). Install the release that matches torch {torch.__version__.split('+')[0]}: "
            f"`{TORCH_XLA_INSTALL}`, and run with an XLA device (e.g. PJRT_DEVICE=CPU)."
        ) from e


def _upstream_compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """Upstream ``openxla``'s AOTAutograd wiring (with our decompositions): nothing deferred."""
    from . import dynamo_bridge

    return aot_autograd(fw_compiler=dynamo_bridge.compile_upstream, decompositions=decompositions.table)(
        gm, example_inputs, **kwargs
    )


def _runs_as_upstream(backend: str, example_inputs: Sequence[Any]) -> bool:
    """Graphs this backend hands to upstream whole: no input on XLA (upstream warns and runs
    them on the CPU), and compiled autograd's backward graphs."""
    from . import dynamo_bridge

    # Compiled autograd first: its graph takes its tensors in a list, so it shows no XLA input.
    return _compiled_autograd_graph(backend) or not dynamo_bridge.on_xla(example_inputs)


def _compiled_autograd_graph(backend: str) -> bool:
    """True while compiled autograd compiles its backward graph; says once per backend that it runs unfused.

    That graph holds the whole backward and the ``.grad`` accumulation as
    in-place updates; it reaches this backend as a graph without a backward
    of its own, and runs through upstream ``openxla`` (correct; an input sync,
    then the graph), not through the deferred backward.
    """
    from torch._dynamo import compiled_autograd

    if not compiled_autograd.in_compiled_autograd_region:
        return False
    _warn_compiled_autograd_once(backend)
    return True


@functools.cache
def _warn_compiled_autograd_once(backend: str) -> None:
    warnings.warn(
        f"{backend}: compiled autograd is enabled, so the backward pass (with its .grad accumulation) "
        f"is traced by compiled autograd into one graph of its own, outside this backend's deferred "
        f"backward: gradients are correct, but the backward runs unfused, as with upstream openxla "
        f"(its pending inputs are synced in an execution of their own). Disable compiled autograd "
        f"for this backend to fuse it."
    )


def openxla_fused_grad(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any
) -> Callable[..., Any]:
    """Dynamo backend: upstream ``openxla`` forward, backward fused with ``.grad`` accumulation.

    Invariant: every backward pass that runs at least one graph compiled here
    ends with exactly one ``_xla_sync_multi`` call, made after the last
    AccumulateGrad node, covering the ``.grad`` of every leaf those graphs feed.
    """
    require_torch_xla()
    from . import dynamo_bridge

    dynamo_bridge.check_inputs_on_xla(gm, example_inputs)
    if _runs_as_upstream(BACKEND_NAME, example_inputs):
        return _upstream_compile(gm, example_inputs, **kwargs)
    return aot_autograd(
        fw_compiler=dynamo_bridge.compile_upstream,
        bw_compiler=dynamo_bridge.compile_deferred_backward,
        decompositions=decompositions.table,
    )(gm, example_inputs, **kwargs)


def openxla_fused_step(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any
) -> Callable[..., Any]:
    """Dynamo backend: forward, backward, accumulation and optimizer as one XLA execution per step.

    Invariant: no graph compiled here executes on its own; the step is cut
    where :mod:`torch_xla_bridge.fused_step` says, and then runs as one
    execution.
    """
    require_torch_xla(STEP_BACKEND_NAME)
    from . import dynamo_bridge, fused_step

    dynamo_bridge.check_inputs_on_xla(gm, example_inputs, STEP_BACKEND_NAME)
    if _runs_as_upstream(STEP_BACKEND_NAME, example_inputs):
        return _upstream_compile(gm, example_inputs, **kwargs)
    return aot_autograd(**fused_step.compilers(), decompositions=decompositions.table)(gm, example_inputs, **kwargs)


_BACKENDS = {BACKEND_NAME: openxla_fused_grad, STEP_BACKEND_NAME: openxla_fused_step}


def register() -> None:
    """Makes ``backend="openxla_fused_grad"`` and ``"openxla_fused_step"`` resolvable; safe to call repeatedly.

    When dynamo has already discovered our ``torch_dynamo_backends`` entry
    point it registers the backend itself on first lookup (registering it here
    too would trip dynamo's duplicate-name check), so only the name's absence
    from both tables leads to registering here.
    """
    from torch._dynamo.backends import registry

    for name, compiler_fn in _BACKENDS.items():
        if name not in registry._COMPILER_FNS and registry._BACKENDS.get(name) is None:
            register_backend(compiler_fn=compiler_fn, name=name)
