"""Runs AOTAutograd backward graphs as one pending XLA node, fused with ``.grad`` accumulation.

With ``openxla`` the backward graph used to run as its own cached program,
after which the autograd engine's AccumulateGrad nodes added each gradient into
``.grad`` lazily, outside any program: ``.grad`` was left as pending IR, and the
next reader (``.grad.cpu()``, the optimizer, whose inputs the bridge syncs) paid
an execution for it; the loss seed of ``loss.backward()`` cost one more.

Here a backward graph is lowered once per input signature to one XLA
computation and embedded per call as a single lazy IR node
(``_xla_user_computation``), so its outputs are pending: the engine's
accumulation lands in the same pending graph, and the input it gets from
outside (the loss seed, upstream gradients) fuses in as well. One engine
callback per backward pass then syncs everything (see :mod:`grad_sync`).

Where that is impossible (double backward, random ops, CPU-fallback ops,
in-place input updates, torch_xla eager mode) a graph runs through the unfused
path instead, correctly, with one warning saying why. Set
``XLA_DYNAMO_FUSED_GRAD=0`` (or ``torch_xla._dynamo.config.fused_backward =
False``) to always take the unfused path.
"""
# The upstream-only part of torch_xla/_dynamo/deferred_backward.py: upstream/make_patch.py
# generates that module from torch_xla_bridge/deferred.py, with this docstring, and appends
# everything below the imports here. The torch_xla_bridge import stands for that module
# (make_patch drops it), so that this file is real, importable Python.

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch_xla._dynamo import grad_sync
from torch_xla.experimental.eager import eager_mode_context

from torch_xla_bridge.deferred import UNFUSED_BACKWARD, DeferredGraph, backward_reason

BACKEND_NAME = "openxla"


def compile_unfused(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list], Any]:
    """The unfused path: the dynamo bridge's compiled graph for ``gm``, built at its first call; called with one list."""
    from torch_xla._dynamo import dynamo_bridge

    compiled: Optional[Callable[..., Any]] = None

    def run(args: list) -> Any:
        nonlocal compiled
        if compiled is None:
            with eager_mode_context(False):
                compiled = dynamo_bridge.extract_compiled_graph_helper(gm, args)
        return compiled(*args)

    return run


def compile_deferred_backward(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> DeferredGraph:
    """An AOTAutograd backward compiler: ``aot_autograd(fw_compiler=..., bw_compiler=this)``.

    Its outputs, with the engine's accumulation into ``.grad``, are synced once per backward pass.
    """
    return DeferredGraph(
        gm,
        example_inputs,
        backend=BACKEND_NAME,
        upstream_compiler=compile_unfused,
        kind="backward",
        on_pending=grad_sync.sync_at_end_of_backward,
        upstream_reason=backward_reason,
        unfused_effect=UNFUSED_BACKWARD,
    )


def is_backward_graph(gm: torch.fx.GraphModule) -> bool:
    """True for an AOTAutograd backward graph: its inputs include tangents (torch's partitioner names them so)."""
    return any(str(n.target).startswith("tangents") for n in gm.graph.find_nodes(op="placeholder"))


def extract_deferred_backward(gm: torch.fx.GraphModule, xla_args: Sequence[Any]) -> Callable[..., Any]:
    """The dynamo bridge's compiled function for a backward graph; called with unpacked arguments.

    The signature cache looks at the graph's traced (possibly symbolic)
    input values, not at the first call's concrete ones, so a graph traced
    with dynamic shapes is lowered per concrete shape.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    example_inputs = [n.meta.get("val", a) for n, a in zip(placeholders, xla_args)]
    deferred = compile_deferred_backward(gm, example_inputs)

    def run(*args: Any) -> Any:
        return deferred(list(args))

    return run
