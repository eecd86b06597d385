"""The upstream (unfused) path: graphs that run through torch_xla's own dynamo bridge.

Every graph the backends do not defer goes through :func:`compile_upstream`:
``openxla_fused_grad``'s forwards and compiled optimizer steps, graphs whose
inputs are not on XLA, compiled autograd's backward graphs, and every
deferred graph that falls back (:mod:`torch_xla_bridge.deferred`). It is
upstream ``openxla``'s compiled function with three differences, all for
correctness:

- **Pending inputs are synced without donating their buffers** first, so
  upstream's own (donating) input sync finds nothing to do (see
  :func:`_inputs_synced_first`).
- **Under SPMD the input-sharding check never expires.** Upstream's bridge
  compares a graph's input shardings with the traced ones, and retraces on a
  difference, only for ``XLA_DYNAMO_INPUT_SHARDING_CHECK_THRESHOLD`` (5)
  calls after the last change; then it stops checking, and a later change
  runs the stale program (measured: "Executable expected parameter ... of
  size 32 but got buffer with incompatible size 64"). Here every call runs
  in :func:`sharding_check_never_expires`: one string comparison per call,
  and a change at any step retraces. (Keeping one traced graph per layout
  and reusing it on a switch back was tried and rejected: under SPMD
  upstream's traces can bind an argument's buffer as a constant, because a
  device buffer's recorded tensor id need not be its tensor's, so a reused
  trace can compute with stale values.)
- **Under SPMD its arguments are matched by buffer.** Upstream's bridge
  binds a traced graph's device-data input to an argument by the tensor id
  recorded on its buffer, which SPMD re-records every time the tensor's IR
  is taken: an argument an earlier graph read (a batch read by two graphs
  around a graph break, e.g. as a model's input and its loss's labels) was
  bound as a constant, the first call's buffer. Here each traced graph maps
  such inputs to the argument with the same buffer
  (:func:`_private.graph_inputs_matched_by_buffer`), and CPU constants the
  graph copies to XLA at every call are copied once
  (:func:`_constants_moved_to_xla_once`), so that no fresh, unsharded input
  makes the bridge retrace at every call.

The checks that route a graph here, or reject it, live here too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch_xla.runtime as xr

from . import _private, grad_sync
from .names import INPUT_SYNC_COUNTER, STEP_BACKEND_NAME

log = logging.getLogger(__name__)


def on_xla(example_inputs: Sequence[Any]) -> bool:
    """Whether any graph input is on an XLA device (a graph with none runs as upstream runs it)."""
    return any(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in example_inputs)


def check_inputs_on_xla(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], backend: str) -> None:
    """Raises if, beside inputs on XLA, an input that requires grad lives off the XLA device.

    Such an input is a parameter (or a trained input) never moved to XLA
    while the rest of the model was: upstream would train it on the CPU,
    silently. Other CPU inputs (data, every input of an all-CPU graph) are
    allowed: their graph runs unfused through upstream, which warns and runs
    them as it does.
    """
    if not on_xla(example_inputs):
        return
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    for i, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor) or t.device.type == "xla" or not t.requires_grad:
            continue
        name = names[i] if i < len(names) else f"input {i}"
        raise RuntimeError(
            f"backend={backend!r}: graph input {name!r} (shape {tuple(t.shape)}, "
            f"dtype {t.dtype}, requires grad) is on device {t.device}, not on an XLA device. "
            f"Move the model and its inputs to XLA first: `device = torch_xla.device()`, "
            f"`model.to(device)`, `x = x.to(device)`."
        )


def compile_upstream(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list], Any]:
    """Upstream ``openxla``'s unfused compiled function for ``gm``; called with one list (boxed).

    Invariants: its pending inputs are synced without buffer donation before
    upstream's bridge sees them; under SPMD its input-sharding check never
    expires. Without SPMD, and with nothing pending, it is upstream's
    ``openxla_eval_boxed`` behind one check.
    """
    from torch._dynamo.backends.torchxla import openxla_eval_boxed

    if xr.is_spmd():
        _constants_moved_to_xla_once(gm)
    compiled = openxla_eval_boxed(gm, example_inputs)
    if xr.is_spmd():
        compiled = _sharding_check_kept(compiled, [n.name for n in gm.graph.find_nodes(op="placeholder")])
    return _inputs_synced_first(compiled)


def _constants_moved_to_xla_once(gm: torch.fx.GraphModule) -> None:
    """Replaces, in place, each CPU tensor constant that ``gm`` copies to XLA at every call by one XLA constant.

    A tensor the traced code creates (``torch.tensor(...)``, e.g. a mask's
    fill value) reaches the graph as ``get_attr`` -> ``lift_fresh_copy`` ->
    ``_to_copy(device=xla)``. Upstream's bridge runs those nodes as CPU
    fallback ops outside its XLA program, so each call hands the program a
    fresh, unsharded tensor, whose sharding the program's execution turns
    into ``{replicated}``: under SPMD the bridge sees a changed input layout
    at every call and retraces, and each retrace binds the arguments whose
    IR was taken before as constants
    (``upstream/bugs/spmd_checkpoint_stale_backward.py``). Measured on a tiny
    HF Llama under FSDPv2 with gradient checkpointing: ``openxla_fused_grad``
    trained on stale parameters from the second step. The copy is of a
    constant into a functional graph, so one XLA copy made here is the same
    value at every call; the program then reads it as a constant of its own.
    """
    aten = torch.ops.aten
    for node in list(gm.graph.find_nodes(op="call_function", target=aten._to_copy.default)):
        device = node.kwargs.get("device")
        source = node.args[0]
        if source.op == "call_function" and source.target is aten.lift_fresh_copy.default:
            source = source.args[0]
        if device is None or torch.device(device).type != "xla" or source.op != "get_attr":
            continue
        value = getattr(gm, source.target)
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            continue
        name = f"_xla_constant_{source.target}_{node.name}"
        with _private.fake_mode_off():  # a real XLA tensor, not a fake one
            setattr(gm, name, aten._to_copy.default(value, *node.args[1:], **node.kwargs))
        with gm.graph.inserting_before(node):
            replacement = gm.graph.get_attr(name)
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        log.debug("graph constant %s copied to XLA once, as %s", source.target, name)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def boxed(fn: Callable[[list], Any]) -> Callable[[list], Any]:
    """Marks ``fn`` as taking AOTAutograd's boxed calling convention (one list, which it may clear)."""
    fn._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd: one list argument
    return fn


def _inputs_synced_first(compiled: Callable[[list], Any]) -> Callable[[list], Any]:
    """``compiled``, with its pending inputs synced first without donating their buffers.

    Upstream's bridge syncs a graph's pending inputs (e.g. ``.grad`` that
    ``clip_grad_norm_`` scaled) with buffer donation before running it, and
    deletes buffers that other pending IR (the norm it returned) still reads;
    syncing them here first, as :func:`grad_sync.sync` does, leaves upstream's
    sync nothing to do. Counted under upstream's own counter for such syncs.
    """

    def run_with_inputs_synced(args: list) -> Any:
        if not _private.execution_allowed():
            # Upstream's bridge executes the graph at every call (and once more to warm its cache
            # at the first); torch_xla would stop that with "Unexpected execution happens inside
            # the compiled function", naming neither cause nor fix. Nothing has run yet.
            raise RuntimeError(
                "this graph runs through torch_xla's dynamo bridge, which executes it at every call, and "
                "torch_xla.compile(fn, full_graph=True) allows no execution inside fn. Compile the model with "
                f"backend='{STEP_BACKEND_NAME}' (its step is one execution, run by torch_xla.compile's own "
                "sync when fn returns), or call torch_xla.compile(fn) without full_graph=True."
            )
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        # With torch_xla._dynamo.config.skip_input_data_check the user asked upstream not to
        # sync inputs at all (it then rejects a pending one): leave that to upstream too.
        if tensors and not _private.dynamo_config.skip_input_data_check:
            pending = [t for t, n in zip(tensors, _private.need_materialization(tensors)) if n]
            if pending:
                _private.increment_counter(INPUT_SYNC_COUNTER, 1)
                # Blocking, as upstream's: its bridge reads the inputs' buffers next.
                grad_sync.sync(pending, wait=True)
        return compiled(args)

    return boxed(run_with_inputs_synced)


def _sharding_check_kept(compiled: Callable[[list], Any], names: Sequence[str]) -> Callable[[list], Any]:
    """``compiled`` run in :func:`sharding_check_never_expires`, saying once when its input layout changes.

    A change is correct (upstream's bridge retraces), but it retraces at
    every change: a graph whose inputs alternate between layouts is traced
    anew at every call, where the caller most likely meant one layout.
    """
    last: list[Optional[list[str]]] = [None]
    warned = [False]

    def run_with_sharding_check(args: list) -> Any:
        tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device.type == "xla"]
        # No sharding and replicated are one layout (a buffer that an execution wrote reads as replicated).
        specs = [spec or _REPLICATED for spec in _private.sharding_specs([a for _, a in tensors])]
        if last[0] is not None and specs != last[0] and not warned[0]:
            warned[0] = True
            _warn_layout_change(names, tensors, last[0], specs)
        last[0] = specs
        with sharding_check_never_expires(), _private.graph_inputs_matched_by_buffer():
            return compiled(args)

    return boxed(run_with_sharding_check)


def _warn_layout_change(
    names: Sequence[str], tensors: Sequence[tuple[int, torch.Tensor]], old: Sequence[str], new: Sequence[str]
) -> None:
    changed = [
        f"{names[i] if i < len(names) else f'input {i}'} (shape {tuple(t.shape)}, {t.dtype}): "
        f"{a} -> {b}"
        for (i, t), a, b in zip(tensors, old, new)
        if a != b
    ]
    warnings.warn(
        f"a graph that runs through torch_xla's dynamo bridge got inputs sharded differently from its last call: "
        f"{'; '.join(changed)}. It is retraced (correct, but the bridge keeps one trace per graph, so inputs that "
        f"alternate between layouts are retraced at every call). Shard each input the same way at every call "
        f"(the same xs.mark_sharding spec for every batch), or compile with backend='{STEP_BACKEND_NAME}', which "
        f"compiles one program per layout and switches between them without retracing."
    )


_REPLICATED = "{replicated}"
_THRESHOLD_ENV = "XLA_DYNAMO_INPUT_SHARDING_CHECK_THRESHOLD"
# Calls between two checks of upstream's counter: in effect never runs out.
_NEVER = str(2**62)
# Threads inside the scope, and the variable's value before the first entered it.
_scope_lock = threading.Lock()
_scope_depth = 0
_scope_saved: "str | None" = None


@contextlib.contextmanager
def sharding_check_never_expires() -> Iterator[None]:
    """Within this scope upstream's bridge reads an input-sharding check threshold that never runs out.

    Upstream has no option for it: its bridge reads the threshold from the
    environment when it traces a graph and again after every retrace (both
    inside a call), so the variable is set for the scope's duration. The
    scope nests and is shared by threads: the first to enter sets the
    variable, the last to leave restores the user's value (or its absence).
    """
    global _scope_depth, _scope_saved
    with _scope_lock:
        if _scope_depth == 0:
            _scope_saved = os.environ.get(_THRESHOLD_ENV)
            os.environ[_THRESHOLD_ENV] = _NEVER
        _scope_depth += 1
    try:
        yield
    finally:
        with _scope_lock:
            _scope_depth -= 1
            if _scope_depth == 0:
                if _scope_saved is None:
                    os.environ.pop(_THRESHOLD_ENV, None)
                else:
                    os.environ[_THRESHOLD_ENV] = _scope_saved
