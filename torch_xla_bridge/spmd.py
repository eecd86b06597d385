"""SPMD (``torch_xla.runtime.use_spmd()``): shardings that the fused backward must respect.

Two things differ from a single device:

- **Gradients keep their parameter's sharding.** Nothing in the backward pins
  the sharding of a gradient, so the partitioner picks one (e.g. a
  ``[4,1]``-sharded weight got a ``[1,4]`` gradient, a sharded bias a
  replicated one). :func:`keep_param_shardings` annotates each pending
  ``.grad`` with its parameter's sharding before the end-of-backward sync, so
  the partitioner produces it in that layout inside the same execution.
- **Input shardings can change between calls.** Upstream's bridge compares
  a graph's input shardings with the traced ones, and retraces on a
  difference, only for ``XLA_DYNAMO_INPUT_SHARDING_CHECK_THRESHOLD`` (5)
  calls after the last change; then it stops checking, and a later change
  runs the stale program (measured: "Executable expected parameter ... of
  size 32 but got buffer with incompatible size 64"). The graphs this backend
  hands to upstream's bridge (forward, optimizer, fallbacks) run with that
  check never expiring (:func:`compile_upstream`): one string comparison per
  call, and a change at any step retraces. (Keeping one traced graph per
  layout and reusing it on a switch back was tried and rejected: under SPMD
  upstream's traces can bind an argument's buffer as a constant, because a
  device buffer's recorded tensor id need not be its tensor's, so a reused
  trace can compute with stale values.)

The deferred backward needs neither: its lowered computation carries no
sharding (it is traced from placeholders), and the partitioner shards it
afresh from its actual inputs whenever the enclosing lazy graph is compiled;
torch_xla's graph hash includes the input shardings, so a new layout compiles
a new program and a seen one is a cache hit.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Sequence

import torch
import torch_xla
import torch_xla.runtime as xr

log = logging.getLogger(__name__)

_THRESHOLD_ENV = "XLA_DYNAMO_INPUT_SHARDING_CHECK_THRESHOLD"

# Calls between two checks of upstream's counter: in effect never runs out.
_NEVER = str(2**62)


def keep_param_shardings(leaves: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Makes each pending ``grad`` come out of its execution sharded like its ``param``.

    ``leaves`` holds ``(param, grad)`` pairs. A no-op without SPMD (checked
    once per call: this runs on every backward), for an unsharded parameter,
    and where the shardings already agree (every step after the first, for an
    accumulated ``.grad``).
    """
    if not leaves or not xr.is_spmd():
        return
    for param, grad in leaves:
        spec = torch_xla._XLAC._get_xla_sharding_spec(param)
        if spec and spec != torch_xla._XLAC._get_xla_sharding_spec(grad):
            torch_xla._XLAC._xla_mark_sharding(grad, torch_xla._XLAC._get_xla_op_sharding(param))


@contextlib.contextmanager
def _sharding_check_never_expires() -> Iterator[None]:
    # Upstream reads the threshold from the environment when it traces and
    # again after every retrace (inside the call), so both run under this.
    old = os.environ.get(_THRESHOLD_ENV)
    os.environ[_THRESHOLD_ENV] = _NEVER
    try:
        yield
    finally:
        if old is None:
            del os.environ[_THRESHOLD_ENV]
        else:
            os.environ[_THRESHOLD_ENV] = old


def compile_upstream(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list], Any]:
    """Upstream ``openxla``'s graph compiler; under SPMD its input-sharding check never expires.

    Without SPMD this is ``openxla_eval_boxed`` itself, unchanged.
    """
    from torch._dynamo.backends.torchxla import openxla_eval_boxed

    compiled = openxla_eval_boxed(gm, example_inputs)
    if not xr.is_spmd():
        return compiled

    def run(args: list) -> Any:
        with _sharding_check_never_expires():
            return compiled(args)

    run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd: one list argument
    return run
