"""Registration of ``openxla_fused_grad`` and ``openxla_fused_step``, and their AOTAutograd wiring.

Both backends are upstream ``openxla`` with compilers of their own, wired
into AOTAutograd here; the mechanisms live below (each module imports only
modules listed after it):

- :mod:`.fused_step`: the step policy of ``openxla_fused_step`` (when the
  step is cut, what joins it);
- :mod:`.deferred`: a graph run as one pending XLA node (lowering,
  embedding, validation, fallback);
- :mod:`.dynamo_bridge`: the upstream (unfused) path through torch_xla's
  bridge, with its SPMD handling;
- :mod:`.optimizer_sync`: ``openxla_fused_grad``'s step barrier after an
  eager optimizer step (no step grows into the next);
- :mod:`.dynamo_fallback`: when dynamo gives up on a function (its
  ``recompile_limit``): the optimizer's step counts, and the one warning;
- :mod:`.grad_sync`: the one sync, and the end-of-backward engine callback;
- :mod:`.in_flight`: the buffers a step's execution donates, held until the
  barrier after next, so no call of the loop waits for that execution;
- :mod:`.counting`, :mod:`._private`, :mod:`.names`: counting executions,
  private torch/torch_xla APIs, names and pins.

``openxla_fused_grad``: forwards run through upstream's bridge, the backward
is deferred and synced with the ``.grad`` accumulation by one engine
callback. ``openxla_fused_step``: every graph is deferred until the step is
cut. Both trace with :mod:`.decompositions`, which replaces ops whose
torch_xla lowering disagrees with eager PyTorch.

Importing this module imports neither torch_xla nor the mechanisms (dynamo
can list the backends and the entry point load them without torch_xla, and
torch_xla reads its environment when it is first imported, which stays the
user's choice); they are imported when a graph is compiled, after
:func:`require_torch_xla`.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import warnings
from typing import Any, Callable, Sequence

import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import register_backend

from . import decompositions
from .names import BACKEND_NAME, STEP_BACKEND_NAME, TORCH_XLA_INSTALL

log = logging.getLogger(__name__)


def register() -> None:
    """Makes ``backend="openxla_fused_grad"`` and ``"openxla_fused_step"`` resolvable; safe to call repeatedly.

    When dynamo has already discovered our ``torch_dynamo_backends`` entry
    point it registers the backend itself on first lookup (registering it here
    too would trip dynamo's duplicate-name check), so only the name's absence
    from both tables leads to registering here.
    """
    # Public API, and no torch_xla import: users set torch_xla's environment variables
    # (PT_XLA_DEBUG_LEVEL, ...) after importing this package, before torch_xla is imported.
    known = set(torch._dynamo.list_backends(exclude_tags=()))
    for name, compiler_fn in _BACKENDS.items():
        if name not in known:
            register_backend(compiler_fn=compiler_fn, name=name)
    _listen()


def _listen() -> None:
    """Keeps :func:`_at_compile_start` among dynamo's compile-start callbacks, which ``torch._dynamo.reset()``
    clears (each graph compiled here registers it again)."""
    if _at_compile_start not in torch._dynamo.callback_handler.start_callbacks:
        torch._dynamo.callback_handler.register_start_callback(_at_compile_start)


def _at_compile_start(args: Any = None) -> None:
    """dynamo's compile-start callback: a frame compiled with one of the backends marks its parameters as
    trained with it and registers the backend's optimizer hook, before dynamo traces anything.

    So the step policies hold where dynamo then compiles no graph of the frame
    (a graph break it cannot resume) or gives up on it later
    (:mod:`.dynamo_fallback`). Nothing before torch_xla is imported: no XLA
    tensor exists then, and importing torch_xla stays the user's choice.
    After ``torch._dynamo.reset()`` it runs again from the next graph compiled
    here on (:func:`_upstream_or_none`), so a model of which dynamo compiles no
    graph at all, first compiled after a reset, trains as upstream does.
    """
    if sys.modules.get("torch_xla") is None:  # not imported (or made unimportable)
        return
    from . import dynamo_fallback

    backend = dynamo_fallback.frame_started()
    if backend == STEP_BACKEND_NAME:
        from . import fused_step

        fused_step.register_optimizer_hooks()
    elif backend == BACKEND_NAME:
        from . import optimizer_sync

        optimizer_sync.register_hook()


def openxla_fused_grad(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any
) -> Callable[..., Any]:
    """Dynamo backend: upstream ``openxla`` forward, backward fused with ``.grad`` accumulation.

    Invariant: every backward pass that runs at least one graph compiled here
    ends with exactly one ``_xla_sync_multi`` call, made after the last
    AccumulateGrad node, covering the ``.grad`` of every leaf those graphs feed.
    """
    upstream = _upstream_or_none(BACKEND_NAME, gm, example_inputs, **kwargs)
    if upstream is not None:
        return upstream
    from . import deferred, dynamo_bridge, grad_sync, host_scalars, optimizer_sync

    def bw_compiler(bw_gm: torch.fx.GraphModule, bw_inputs: Sequence[Any]) -> Callable[[list], Any]:
        return deferred.DeferredGraph(
            bw_gm, bw_inputs, backend=BACKEND_NAME, upstream_compiler=dynamo_bridge.compile_upstream,
            kind="backward", on_pending=optimizer_sync.backward_deferred,
            upstream_reason=deferred.backward_reason, unfused_effect=deferred.UNFUSED_BACKWARD,
        )

    def inference_compiler(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> Callable[[list], Any]:
        # A no-backward graph with host scalars (a compiled optimizer's CPU step counts, a
        # tensor lr) runs as one execution of its own; upstream's bridge would split it
        # around the CPU ops into several. Any other runs as upstream runs it.
        if not any(map(host_scalars.is_host_scalar, inputs)):
            return dynamo_bridge.compile_upstream(gm, inputs)
        return deferred.DeferredGraph(
            gm, inputs, backend=BACKEND_NAME, upstream_compiler=dynamo_bridge.compile_upstream,
            kind="no-backward", on_pending=grad_sync.sync_fresh,
        )

    return aot_autograd(
        fw_compiler=dynamo_bridge.compile_upstream, bw_compiler=bw_compiler, inference_compiler=inference_compiler,
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
    upstream = _upstream_or_none(STEP_BACKEND_NAME, gm, example_inputs, **kwargs)
    if upstream is not None:
        return upstream
    from . import fused_step

    # Inference graphs keep their input updates (an optimizer step's copy_ into parameters and
    # state), which the deferred graph writes back as in-place updates, donated by the step.
    return aot_autograd(
        **fused_step.compilers(), decompositions=decompositions.table, keep_inference_input_mutations=True,
    )(gm, example_inputs, **kwargs)


def require_torch_xla(backend: str) -> None:
    """Raises an ImportError naming the install command if torch_xla is missing."""
    from . import _private

    if _private.TORCH_XLA_IMPORT_ERROR is not None:
        e = _private.TORCH_XLA_IMPORT_ERROR
        raise ImportError(
            f"backend={backend!r} needs torch_xla, which could not be imported "
            f"({e}). Install the release that matches torch {torch.__version__.split('+')[0]}: "
            f"`{TORCH_XLA_INSTALL}`, and run with an XLA device (e.g. PJRT_DEVICE=CPU)."
        ) from e


_BACKENDS = {BACKEND_NAME: openxla_fused_grad, STEP_BACKEND_NAME: openxla_fused_step}


def _upstream_or_none(
    backend: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any
) -> "Callable[..., Any] | None":
    """Checks the graph's inputs; for a graph this backend hands to upstream whole, upstream's
    ``openxla`` wiring (with our decompositions), else None.

    Handed over whole: compiled autograd's backward graphs (checked first: such
    a graph takes its tensors in a list, so it shows no XLA input), and graphs
    with no input on XLA (upstream warns and runs them on the CPU).
    """
    require_torch_xla(backend)
    from . import dynamo_bridge, spmd_tracing

    spmd_tracing.install()  # no-op after the first graph; see spmd_tracing

    _listen()
    _at_compile_start()
    _warn_if_recompiled_for_a_float(backend)

    dynamo_bridge.check_inputs_on_xla(gm, example_inputs, backend)
    if not (_compiled_autograd_graph(backend) or not dynamo_bridge.on_xla(example_inputs)):
        return None
    return aot_autograd(fw_compiler=dynamo_bridge.compile_upstream, decompositions=decompositions.table)(
        gm, example_inputs, **kwargs
    )


def _compiled_autograd_graph(backend: str) -> bool:
    """True while compiled autograd compiles its backward graph; says once per backend that it runs unfused.

    That graph holds the whole backward and the ``.grad`` accumulation as
    in-place updates; it reaches this backend as a graph without a backward
    of its own, and runs through upstream ``openxla`` (correct; an input sync,
    then the graph), not through the deferred backward.
    """
    from . import _private

    if not _private.in_compiled_autograd_region():
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


# A guard on a float in an optimizer's param_groups, as dynamo writes it:
# "self.param_groups[0]['lr'] == 0.0004" (or ['betas'][0] == 0.95).
_FLOAT_HYPERPARAMETER_GUARD = re.compile(r"param_groups\[\d+\]\['(\w+)'\](?:\[\d+\])? == -?[\d.e+-]+")


def _warn_if_recompiled_for_a_float(backend: str) -> None:
    """Says once per hyperparameter when dynamo compiles an optimizer step again because a float of it changed.

    torch_xla sets ``torch._dynamo.config.specialize_float = True`` (and turns
    automatic dynamic shapes off), so every new value of a float that a
    compiled ``opt.step`` reads (a scheduler's ``lr``, OneCycleLR's ``betas``)
    is a new dynamo compilation, with any backend, until dynamo's recompile
    limit; then it runs the step uncompiled. A 0-dim tensor is data instead.
    """
    from . import _private

    reason = _private.last_guard_failure()
    match = reason and _FLOAT_HYPERPARAMETER_GUARD.search(reason)
    if match:
        _warn_float_hyperparameter_once(backend, match.group(1), match.group(0))


@functools.cache
def _warn_float_hyperparameter_once(backend: str, name: str, guard: str) -> None:
    warnings.warn(
        f"{backend}: dynamo compiles the optimizer step again because its float {name!r} changed "
        f"(guard failed: {guard}). torch_xla sets torch._dynamo.config.specialize_float=True, so every new "
        f"value is a new compilation, with any backend, up to torch._dynamo.config.recompile_limit; then the "
        f"step runs uncompiled. Pass it as a tensor, which schedulers update in place: e.g. "
        f"`torch.optim.AdamW(params, lr=torch.tensor(1e-3))`; OneCycleLR also cycles Adam's betas "
        f"(`cycle_momentum=False` keeps them fixed)."
    )
