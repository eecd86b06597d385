"""Explaining XLA executions and gradients: a per-step execution report and an autograd graph dump.

- :func:`explain` (context manager): every XLA execution of the code inside,
  per training step, with its cause, graph hash, input/output counts and the
  user's frame; pending IR left on ``.grad``; a one-line verdict.
- ``python -m torch_xla_bridge.explain train.py [--steps N] [args...]``: the same
  for an unchanged training script, with torch_xla's execution analysis on.
- :func:`autograd_graph`: every AccumulateGrad node of a loss's graph and the
  backward nodes feeding each ``.grad``, as text, Graphviz DOT and PNG.

Names are imported lazily so that ``python -m torch_xla_bridge.explain`` can set
torch_xla's debug environment before torch_xla is first imported.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "explain": "recorder",
    "Explainer": "recorder",
    "StopExplain": "recorder",
    "run_script": "script",
    "autograd_graph": "grad_graph",
    "GradGraph": "grad_graph",
    "ExecutionReport": "report",
    "Execution": "report",
    "Cause": "report",
    "print_report": "render",
    "format_text": "render",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
