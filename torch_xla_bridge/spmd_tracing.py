"""``xs.mark_sharding`` inside a ``torch.compile`` region: run at a graph break, on the real tensor.

torch_xla 2.9's ``mark_sharding`` annotates its tensor in place and returns
it wrapped as an ``XLAShardedTensor``, a subclass of DTensor that inherits
DTensor's ``__tensor_flatten__`` (which names ``_local_tensor``) without
having that attribute. Dynamo cannot trace the annotation itself (a pybind
call, ``_xla_mark_sharding``), breaks the graph there, and then fails on the
wrapper the moment any traced frame holds one: ``InternalTorchDynamoError:
AttributeError: 'XLAShardedTensor' object has no attribute '_local_tensor'``.
``torch.compile(SpmdFullyShardedDataParallel(model))`` hits it in every
forward: the wrapper's forward calls ``mark_sharding`` on the output
(``upstream/bugs/fsdpv2_compile_xlashardedtensor.py`` reproduces it).

:func:`install` replaces ``mark_sharding`` in torch_xla's two modules that
export it by a function that, outside a dynamo trace, is the original
(same result, an ``XLAShardedTensor``), and, while dynamo traces, runs the
original at a graph break (``torch.compiler.disable``) on the real tensor and
returns that tensor itself: no traced frame ever holds a wrapper. The
annotation then lands where lazy SPMD puts it, on the tensor's pending value
(or its data) between two graphs, which is what wrapping only the inner
module's forward in ``torch.compile`` does; with any backend, upstream
``openxla`` included.

The cost is that graph break: an annotation in the middle of a forward
splits it in two graphs (with ``openxla_fused_step`` still one execution per
step; with ``openxla_fused_grad`` and ``openxla`` one more forward
execution). At the end of a forward, as in FSDPv2, it costs nothing: the
module's backward hook breaks the graph there anyway.

Installed once per process, as soon as torch_xla is imported and this
package is (``torch_xla_bridge/__init__.py``), or at the latest when one of
our backends compiles its first graph: ``mark_sharding`` looked up through
its module (``xs.mark_sharding``, as FSDPv2 and HF Trainer call it) then
finds the replacement; a reference taken earlier with ``from ... import
mark_sharding`` keeps the original.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

# torch_xla's modules that export mark_sharding (the second re-exports the first's).
_MODULES = ("torch_xla.distributed.spmd.xla_sharding", "torch_xla.distributed.spmd")
_lock = threading.Lock()
_original: "Callable[..., Any] | None" = None


def installed() -> bool:
    """Whether torch_xla's ``mark_sharding`` is the compile-safe replacement."""
    return _original is not None


def install_if_torch_xla_imported() -> None:
    """:func:`install` if torch_xla is already imported; never imports it (its import reads the user's environment)."""
    if sys.modules.get("torch_xla") is not None:  # None: blocked, as if not installed
        install()


def install() -> None:
    """Replaces torch_xla's ``mark_sharding`` by the compile-safe one; idempotent and thread-safe."""
    global _original
    with _lock:
        if _original is not None:
            return
        import importlib

        modules = [importlib.import_module(name) for name in _MODULES]
        original = modules[0].mark_sharding
        replacement = _compile_safe(original)
        for module in modules:
            if getattr(module, "mark_sharding", None) is original:
                module.mark_sharding = replacement
        _original = original
        log.debug("torch_xla's mark_sharding replaced: it runs at a graph break inside torch.compile")


def _compile_safe(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` outside a dynamo trace; inside one, ``original`` run at a graph break, returning its tensor."""

    @torch.compiler.disable
    def annotate_at_graph_break(t: torch.Tensor, mesh: Any, partition_spec: Any) -> None:
        # Runs uncompiled, on the real tensor; returns None, so no XLAShardedTensor reaches the frame
        # that dynamo resumes after the break.
        original(t, mesh, partition_spec)

    @functools.wraps(original)
    def mark_sharding(t: torch.Tensor, mesh: Any, partition_spec: Any) -> Any:
        if torch.compiler.is_compiling():
            annotate_at_graph_break(t, mesh, partition_spec)
            # The annotated tensor itself: what a traced frame can hold (the wrapper only forwards
            # ops to it).
            return t
        return original(t, mesh, partition_spec)

    mark_sharding.__torch_xla_bridge_original__ = original  # type: ignore[attr-defined]
    return mark_sharding
