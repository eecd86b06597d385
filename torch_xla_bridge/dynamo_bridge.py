"""Compiling and running AOTAutograd graphs on XLA, with the backward deferred.

Forward graphs go through torch_xla's own dynamo bridge (upstream ``openxla``).
A backward graph is lowered once per input signature to one XLA computation
and embedded per call as a single lazy IR node (``_xla_user_computation``), so
its outputs are pending, not executed: the autograd engine's ``.grad``
accumulation lands in the same pending graph, and the input it gets from
outside (the loss seed, upstream gradients) fuses in as well.

Where that is impossible (double backward, random ops, CPU-fallback ops,
in-place input updates, torch_xla eager mode) a graph runs through the upstream
path instead, correctly, with one warning saying why.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
from torch_xla.experimental.eager import eager_mode_context, is_eager_mode

from . import grad_sync, spmd
from .backend import BACKEND_NAME

log = logging.getLogger(__name__)

_USER_COMPUTATION_NAME = "xla::openxla_fused_grad_backward"


def check_inputs_on_xla(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Raises if a graph input that is not a CPU scalar lives off the XLA device.

    0-dim CPU tensors are allowed: they act as scalars (optimizer step counts).
    """
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor) or t.device.type == "xla":
            continue
        if t.device.type == "cpu" and t.dim() == 0 and not t.requires_grad:
            continue
        name = names[i] if i < len(names) else f"input {i}"
        raise RuntimeError(
            f"backend={BACKEND_NAME!r}: graph input {name!r} (shape {tuple(t.shape)}, "
            f"dtype {t.dtype}) is on device {t.device}, not on an XLA device. Move the "
            f"model and its inputs to XLA first: `device = torch_xla.device()`, "
            f"`model.to(device)`, `x = x.to(device)`."
        )


def compile_deferred_backward(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list], list]:
    """AOTAutograd backward compiler of ``openxla_fused_grad``."""
    return DeferredBackward(gm, example_inputs)


@dataclasses.dataclass(frozen=True)
class _LoweredBackward:
    """One backward graph lowered for one input signature.

    ``sources[k]`` feeds HLO parameter ``k``: an index into the runtime
    arguments, or a constant tensor the lowering hoisted into a parameter.
    ``outputs[j]`` is an index into the computation's results, or the
    graph's non-tensor output itself (``None``, a Python number).
    """

    computation: Any
    sources: tuple[Union[int, torch.Tensor], ...]
    outputs: tuple[tuple[bool, Any], ...]

    def __call__(self, args: Sequence[Any]) -> tuple[list[Any], list[torch.Tensor]]:
        inputs = [args[s] if type(s) is int else s for s in self.sources]
        results = torch_xla._XLAC._xla_user_computation(_USER_COMPUTATION_NAME, inputs, self.computation)
        outs = [results[v] if is_tensor else v for is_tensor, v in self.outputs]
        return outs, results


_Signature = tuple[Any, ...]


def _full_signature(args: Sequence[Any]) -> _Signature:
    return tuple(
        (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (type(a), a) for a in args
    )


def _static_signature(args: Sequence[Any]) -> _Signature:
    return ()


def _is_static(example_inputs: Sequence[Any]) -> bool:
    """True if AOTAutograd can only ever call the graph with the traced shapes and dtypes."""
    for a in example_inputs:
        if isinstance(a, torch.Tensor):
            if any(not isinstance(d, int) for d in a.shape):
                return False
        elif not isinstance(a, (int, float, bool, type(None))):  # a SymInt, SymFloat, ...
            return False
    return True


class DeferredBackward:
    """Runs a backward graph as one pending XLA node per call.

    Invariants: a given input signature is lowered at most once (the cache key
    is shapes, dtypes and non-tensor values; a graph whose example inputs are
    all static has one signature, so its key is empty); every call inside an
    autograd pass hands its outputs to :func:`grad_sync.sync_at_end_of_backward`.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.gm = gm
        self.example_inputs = example_inputs
        self._signature = _static_signature if _is_static(example_inputs) else _full_signature
        # Per signature: the lowered graph, or why it cannot be lowered (so the
        # probe runs once per signature, not once per call).
        self._lowered: dict[_Signature, Union[_LoweredBackward, str]] = {}
        self._upstream: Optional[Callable[[list], Any]] = None
        self._static_reason = _unfusable_graph_reason(gm)
        self._warned = False
        # AOTAutograd's calling convention: one list argument that we may clear.
        # An instance attribute, so that dynamo's `disable` wrapper copies it.
        self._boxed_call = True

    def __call__(self, args: list) -> Any:
        reason = self._static_reason or _unfusable_mode_reason()
        if reason is None:
            key = self._signature(args)
            lowered = self._lowered.get(key)
            if lowered is None:
                lowered = self._lowered[key] = self._lower(args)
            if isinstance(lowered, str):
                reason = lowered
            else:
                outs, pending = lowered(args)
                args.clear()
                grad_sync.sync_at_end_of_backward(pending)
                return outs
        return self._run_upstream(args, reason)

    def _run_upstream(self, args: list, reason: str) -> Any:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{BACKEND_NAME}: this backward graph runs unfused through upstream openxla "
                f"(gradients correct, but accumulated into .grad outside its execution): {reason}"
            )
        if self._upstream is None:
            # Upstream's bridge partitions the graph module in place; keep ours
            # pristine for lowering later calls (e.g. after one create_graph=True pass).
            self._upstream = spmd.compile_upstream(copy.deepcopy(self.gm), self.example_inputs)
        return self._upstream(args)

    def _lower(self, args: Sequence[Any]) -> Union[_LoweredBackward, str]:
        """Lowers the graph for the signature of ``args``, or returns why it cannot be."""
        reason = self._probe(args)
        if reason is not None:
            return reason
        with torch.no_grad(), eager_mode_context(False):
            placeholders = [
                xb.create_placeholder_tensor(a.shape, a.dtype) if isinstance(a, torch.Tensor) else a
                for a in args
            ]
            traced = self.gm(*placeholders)
            traced = list(traced) if isinstance(traced, (list, tuple)) else [traced]
            out_tensors: list[torch.Tensor] = []
            outputs: list[tuple[bool, Any]] = []
            for o in traced:
                if isinstance(o, torch.Tensor):
                    outputs.append((True, len(out_tensors)))
                    out_tensors.append(o)
                else:
                    outputs.append((False, o))
            ctx = torch_xla._XLAC.lowering.LoweringContext("FusedGradBackward")
            ctx.build(out_tensors)
            computation = xb.computation_from_module_proto(_USER_COMPUTATION_NAME, ctx.hlo())
            # Every device-data leaf of the traced graph is an HLO parameter:
            # our placeholders, and constants the trace created (hoisted).
            params = ctx.device_parameter_id_tensor_mapping()
            sources: list[Union[int, torch.Tensor, None]] = [None] * len(params)
            for i, p in enumerate(placeholders):
                if isinstance(p, torch.Tensor):
                    pid = ctx.tensor_parameter_id(p)
                    if pid >= 0:
                        sources[pid] = i
            for pid, t in params.items():
                if sources[pid] is None:
                    sources[pid] = t
        log.debug(
            "lowered backward graph: %d parameters (%d hoisted constants), %d outputs",
            len(sources),
            sum(not isinstance(s, int) for s in sources),
            len(out_tensors),
        )
        return _LoweredBackward(computation, tuple(sources), tuple(outputs))

    def _probe(self, args: Sequence[Any]) -> Optional[str]:
        """Traces the graph once on the real inputs; returns why it cannot be lowered, if so.

        Placeholder tensors hold no data, and an op that needs data (a CPU
        fallback, a host read) would abort the process on them, so this
        lazy trace on real data must come first. It executes nothing unless
        such an op is present.
        """
        fallbacks_before = _fallback_counts()
        # ExecuteTime is recorded when an execution finishes: let earlier
        # asynchronous ones land first, or they would be counted as ours.
        xm.wait_device_ops()
        executions_before = _execution_count()
        with torch.no_grad(), eager_mode_context(False):
            outs = self.gm(*args)
        flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        del outs
        fallbacks = sorted(
            op for op, n in _fallback_counts().items() if n > fallbacks_before.get(op, 0)
        )
        if fallbacks:
            return f"it contains ops without an XLA lowering (CPU fallback): {', '.join(fallbacks)}"
        if _execution_count() != executions_before:
            return "it reads tensor values on the host while tracing"
        non_xla = [o for o in flat if isinstance(o, torch.Tensor) and o.device.type != "xla"]
        if non_xla:
            return f"it produces a tensor on {non_xla[0].device}"
        return None


def _unfusable_graph_reason(gm: torch.fx.GraphModule) -> Optional[str]:
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            return f"it draws random numbers ({node.target}), which a cached computation would freeze"
        if node.target._schema.is_mutable:
            return f"it updates a tensor in place ({node.target})"
        if node.target is torch.ops.aten._local_scalar_dense.default:
            return f"it reads a tensor value on the host ({node.target})"
    return None


def _unfusable_mode_reason() -> Optional[str]:
    if torch.is_grad_enabled() or _in_aot_double_backward():
        return "the backward pass builds a graph (create_graph=True)"
    if is_eager_mode():
        return "torch_xla eager mode executes every accumulation on its own"
    return None


def _in_aot_double_backward(max_depth: int = 8) -> bool:
    """True when AOTAutograd runs this backward for ``create_graph=True``.

    AOTAutograd then calls the backward graph from the forward of its
    ``CompiledFunctionBackward`` autograd.Function, where grad mode is off, so
    grad mode cannot tell; the caller's frame can.
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code.co_qualname.endswith("CompiledFunctionBackward.forward"):
            return True
        frame = frame.f_back
    return False


def _fallback_counts() -> dict[str, int]:
    return {op: met.counter_value(op) or 0 for op in met.executed_fallback_ops()}


def _execution_count() -> int:
    # Under SPMD every execution is a replicated one, recorded under its own metric.
    return sum((met.metric_data(m) or (0,))[0] for m in ("ExecuteTime", "ExecuteReplicatedTime"))
