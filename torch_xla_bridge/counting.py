"""Counting XLA executions: the one definition the core, explain, benchmarks, tests and examples share.

Two counts, for two questions:

- :func:`executions`: programs the device has run (``ExecuteTime`` plus,
  under SPMD, ``ExecuteReplicatedTime``). Recorded when an execution
  finishes, so exact only after ``xm.wait_device_ops()`` (``wait=True``).
- :func:`launches`: syncs of pending IR launched so far, read from the
  compile counters every launch bumps on the calling thread: exact the
  moment a sync returns, and cheap enough for a hot path (the fused step's
  read detection).
"""

from __future__ import annotations

import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met

from . import _private
from .names import COMPILE_COUNTERS, EXECUTE_METRICS, FRESH_STATE_COUNTER, VALIDATION_COUNTER


def counter(name: str) -> int:
    """A torch_xla counter's value (0 before its first bump)."""
    return met.counter_value(name) or 0


def bump(name: str) -> None:
    """Adds one to a torch_xla counter (shown by ``metrics_report()``)."""
    _private.increment_counter(name, 1)


def executions(wait: bool = True) -> int:
    """XLA programs executed so far in this process; with ``wait``, after pending ones finish.

    Starts nothing: before the runtime is up nothing has run, and waiting would
    start it, in single-device mode, before a script's ``xr.use_spmd()``.
    """
    if wait and _private.runtime_initialized():
        xm.wait_device_ops()
    return sum((met.metric_data(m) or (0,))[0] for m in EXECUTE_METRICS)


def launches() -> int:
    """Executions of pending IR launched so far in this process.

    Every sync of a non-empty graph compiles it or finds it compiled
    (``UncachedCompile`` / ``CachedCompile``) on the calling thread. Upstream's
    bridge clears counters while it compiles a graph; a count that drops then
    can only hide a launch, never invent one. Compiles that only validate a
    new lowering (:data:`~torch_xla_bridge.names.VALIDATION_COUNTER`) launch
    nothing and are not counted.
    """
    return sum(counter(c) for c in COMPILE_COUNTERS) - counter(VALIDATION_COUNTER)


def step_launches() -> int:
    """:func:`launches`, less openxla_fused_step's syncs of fresh optimizer state and buffers
    (:data:`~torch_xla_bridge.names.FRESH_STATE_COUNTER`), which read and donate nothing of a step."""
    return launches() - counter(FRESH_STATE_COUNTER)


def fallback_counts() -> dict[str, int]:
    """Per op without an XLA lowering: how often it ran through the CPU fallback so far."""
    return {op: counter(op) for op in met.executed_fallback_ops()}
