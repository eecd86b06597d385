"""``xs.mark_sharding`` inside a ``torch.compile`` region: run at a graph break, on the real tensor.

torch_xla 2.9's ``mark_sharding`` (and ``annotate_custom_sharding``) annotates
its tensor in place and returns it wrapped as an ``XLAShardedTensor``, a
subclass of DTensor that inherits DTensor's ``__tensor_flatten__`` (which names
``_local_tensor``) without having that attribute. Dynamo cannot trace the
annotation itself (a pybind call), breaks the graph there, and then fails on
the wrapper the moment any traced frame holds one: ``InternalTorchDynamoError:
AttributeError: 'XLAShardedTensor' object has no attribute '_local_tensor'``.
``torch.compile(SpmdFullyShardedDataParallel(model))`` hits it in every
forward: the wrapper's forward calls ``mark_sharding`` on the output
(``upstream/bugs/fsdpv2_compile_xlashardedtensor.py`` reproduces it).

:func:`install` replaces both in torch_xla's two modules that export them by
functions that, outside a dynamo trace, are the originals (same result, an
``XLAShardedTensor``), and, while dynamo traces, run the original at a graph
break (``torch.compiler.disable``) on the real tensor and return that tensor
itself: no traced frame ever holds a wrapper. The annotation then lands where
lazy SPMD puts it, on the tensor's pending value (or its data) between two
graphs, which is what wrapping only the inner module's forward in
``torch.compile`` does; with any backend, upstream ``openxla`` included.
Two cases differ from lazy SPMD because the graph before the break has run
(``openxla_fused_grad``, ``openxla``: its outputs are sharded device data,
which torch_xla refuses to re-annotate):

- an activation (it has a ``grad_fn``) gets the annotation as a custom
  sharding on top of its data, the constraint it would have been on its
  pending IR;
- a parameter or input that is already sharded otherwise raises torch_xla's
  error (lazy SPMD raises it too), reworded to name the call site, the
  tensor and what to change; nothing has been updated at that point;
- ``xs.mark_sharding_with_gradients``, whose op dynamo runs eagerly after a
  graph break, annotates a fresh copy of its activation (and, in the
  backward, of its gradient): after an executed graph that copy reads
  sharded data and has its sharding, so the op's annotation, outside any
  trace, becomes a custom sharding on it too (that op only: a user's own
  re-annotation outside a trace raises, as in lazy SPMD).

The cost is that graph break: an annotation in the middle of a forward
splits it in two graphs (with ``openxla_fused_step`` still one execution per
step; with ``openxla_fused_grad`` and ``openxla`` one more forward
execution). At the end of a forward, as in FSDPv2, it costs nothing: the
module's backward hook breaks the graph there anyway.

Installed once per process, as soon as torch_xla is imported and this
package is (``torch_xla_bridge/__init__.py``), or at the latest when one of
our backends compiles its first graph: an annotation looked up through its
module (``xs.mark_sharding``, as FSDPv2 and HF Trainer call it) then finds
the replacement; a reference taken earlier with ``from ... import
mark_sharding`` keeps the original.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

# torch_xla's modules that export the annotations (the second re-exports the first's).
_MODULES = ("torch_xla.distributed.spmd.xla_sharding", "torch_xla.distributed.spmd")
# The annotations replaced: both annotate in place and return an XLAShardedTensor.
_FUNCTIONS = ("mark_sharding", "annotate_custom_sharding")
# torch_xla's check when a device tensor that has a sharding is given another one.
_ALREADY_SHARDED = "Existing annotation must be cleared first"
_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_unavailable: list[Exception] = []  # why install() found nothing to replace, once it has looked


def installed() -> bool:
    """Whether torch_xla's annotations are the compile-safe replacements."""
    return bool(_originals)


def install_if_torch_xla_imported() -> None:
    """:func:`install` if torch_xla is already imported; never imports it (its import reads the user's environment)."""
    if sys.modules.get("torch_xla") is not None:  # None: blocked, as if not installed
        install()


def install() -> None:
    """Replaces torch_xla's ``mark_sharding`` and ``annotate_custom_sharding`` by compile-safe ones; idempotent, thread-safe."""
    with _lock:
        if _originals or _unavailable:
            return
        import importlib

        try:
            modules = [importlib.import_module(name) for name in _MODULES]
            originals = {name: getattr(modules[0], name) for name in _FUNCTIONS}
        except (ImportError, AttributeError) as e:  # a torch_xla without SPMD: nothing to make compile-safe
            _unavailable.append(e)
            log.warning("torch_xla's SPMD annotations not found (%s): left as they are", e)
            return
        custom = originals["annotate_custom_sharding"]
        for name, original in originals.items():
            replacement = _compile_safe(original, custom)
            for module in modules:
                if getattr(module, name, None) is original:
                    setattr(module, name, replacement)
        _originals.update(originals)
        log.debug("torch_xla's %s replaced: they run at a graph break inside torch.compile", ", ".join(_FUNCTIONS))


def _compile_safe(original: Callable[..., Any], annotate_custom: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` outside a dynamo trace; inside one, ``original`` run at a graph break, returning its tensor."""

    @torch.compiler.disable
    def annotate_at_graph_break(t: torch.Tensor, mesh: Any, partition_spec: Any) -> None:
        # Runs uncompiled, on the real tensor; returns None, so no XLAShardedTensor reaches the frame
        # that dynamo resumes after the break.
        try:
            original(t, mesh, partition_spec)
        except RuntimeError as e:
            if _ALREADY_SHARDED not in str(e):
                raise
            if t.grad_fn is None:
                raise _already_sharded_error(original.__name__, t, partition_spec) from e
            # An activation that the graph before the break computed, and sharded as the partitioner
            # chose. In lazy SPMD it would still be pending IR and take the annotation as a sharding
            # constraint; so it does here, on top of its data, for the programs that read it.
            annotate_custom(t, mesh, partition_spec)

    @functools.wraps(original)
    def annotate(t: torch.Tensor, mesh: Any, partition_spec: Any) -> Any:
        if torch.compiler.is_compiling():
            annotate_at_graph_break(t, mesh, partition_spec)
            # The annotated tensor itself: what a traced frame can hold (the wrapper only forwards
            # ops to it).
            return t
        try:
            return original(t, mesh, partition_spec)
        except RuntimeError as e:
            if _ALREADY_SHARDED not in str(e) or not _called_by_mark_sharding_with_gradients():
                raise
            # xs.mark_sharding_with_gradients' op annotates a copy of its activation, run eagerly
            # where dynamo breaks the graph at it. After a graph that executed (openxla_fused_grad,
            # openxla) the copy reads sharded device data and has its sharding, where in lazy SPMD
            # it is pending IR: the annotation becomes the constraint it would have been there.
            return annotate_custom(t, mesh, partition_spec)

    annotate.__torch_xla_bridge_original__ = original  # type: ignore[attr-defined]
    return annotate


def _called_by_mark_sharding_with_gradients() -> bool:
    """Whether the annotation's caller is torch_xla's op behind ``xs.mark_sharding_with_gradients``
    (``_aot_mark_sharding``, which annotates a fresh copy of its input)."""
    caller = sys._getframe(2).f_code
    return caller.co_name == "_aot_mark_sharding" and f"{os.sep}torch_xla{os.sep}" in caller.co_filename


def _already_sharded_error(function: str, t: torch.Tensor, partition_spec: Any) -> RuntimeError:
    """The error for re-annotating a parameter or input inside a compiled region, naming the call and what to change."""
    from . import _private

    kind = "a parameter" if t.requires_grad else "an input of the compiled region (or a tensor from outside it)"
    where = _caller() or "inside the compiled function"
    return RuntimeError(
        f"xs.{function}(t, mesh, {tuple(partition_spec)!r}) at {where}, inside torch.compile: t (shape "
        f"{tuple(t.shape)}, dtype {t.dtype}) is {kind} whose data is already sharded as "
        f"{_private.sharding_spec(t)}, and torch_xla re-annotates no sharded device tensor ('{_ALREADY_SHARDED}'; "
        f"lazy SPMD raises the same). Annotate it once, before the compiled call (as FSDPv2 shards parameters "
        f"when it wraps the model), or call xs.clear_sharding(t) first if its layout must change. Nothing ran "
        f"past this point of the forward: parameters and optimizer state are as they were."
    )


# Directories whose frames are not the user's call site (torch_xla's are recognised by name).
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, os.path.dirname(os.path.abspath(__file__)) + os.sep)


def _caller() -> Optional[str]:
    """``file:line`` of the innermost frame outside torch, torch_xla and this package (the annotation's call site)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_LIBRARY_DIRS) and f"{os.sep}torch_xla{os.sep}" not in path:
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return None
