"""A training step handed over whole and replayed: ``@torch_xla_bridge.replayed_step``.

The drop-in fused step traces every step again (forward, backward,
optimizer), because nothing tells it that the next step is the same. A
function decorated with :func:`replayed_step` says so: it is the whole step
(forward, backward, optimizer step, ``zero_grad``), its batch comes in as
arguments, and it reads and writes the same tensors every call. After
``WARMUP_CALLS`` ordinary calls (the first creates the optimizer's state),
one call is traced with executions held back and captured: the program
its cut compiles (every pending tensor, in torch_xla's order, so the very
program a traced call runs), where each input comes from (an argument by
position, a module's or optimizer's tensor by reference, or a Python
number of the trace), and which outputs become the state it writes, new
``.grad`` and its results; then the step is cut as usual. From then on a
call checks its guards, runs the cached program on the current inputs
(torch_xla's ``_run_cached_graph``, as its dynamo bridge replays an
inference graph) and gives each written tensor its new value: no tracing,
no autograd engine, no walk of live tensors.

Invariants: a replay computes what tracing the call computes, bitwise (the
same program); a call whose guards fail is traced again (counted, warned
once per cause) and captured anew, at most ``MAX_CAPTURES`` times, after
which the step is always traced; what cannot be replayed safely (a step
that draws random numbers, adds step closures, keeps pending tensors
outside its state and results, reads a tensor from outside, runs under
SPMD) is traced on every call, with one warning naming the cause. The
decorated function holds its program and, weakly, the state it reads and
writes.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import types
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from . import _private, counting, fused_step
from .names import REPLAY_CAPTURE_COUNTER, REPLAY_COUNTER, STEP_BACKEND_NAME, VALIDATION_COUNTER

log = logging.getLogger(__name__)

# Ordinary calls before the first capture: the first creates the optimizer's state, the second is steady.
WARMUP_CALLS = 2
# Captures per decorated function (the first included) before it is always traced.
MAX_CAPTURES = 8

_ARG, _STATE, _CONSTANT = 0, 1, 2


def replayed_step(fn: Callable[..., Any]) -> "ReplayedStep":
    """Decorates a whole training step to be replayed after warm-up (see the module).

    ``fn`` trains with ``openxla_fused_step`` (its model compiled with it) and
    does the whole step: forward, backward, optimizer step, ``zero_grad``.
    Its tensor arguments (the batch) may change value between calls; a new
    shape or dtype, or a changed non-tensor argument, is a new capture.
    """
    return functools.wraps(fn)(ReplayedStep(fn))


@dataclasses.dataclass
class _Guards:
    """What a capture assumed, compared on every call (cheap: identities, shapes, Python numbers)."""

    args: tuple
    # Per optimizer: its parameters' identities and its hyperparameters (everything but the params).
    optimizers: list[tuple[weakref.ref[torch.optim.Optimizer], tuple]]
    # Each trained parameter's requires_grad.
    params: list[weakref.ref[torch.Tensor]]
    requires_grad: tuple

    def failed(self, args: tuple) -> Optional[str]:
        """Why this call cannot replay the capture, or None."""
        if args != self.args:
            return "its arguments changed (a new shape, dtype or non-tensor value)"
        for ref, snapshot in self.optimizers:
            optimizer = ref()
            if optimizer is None or _optimizer_snapshot(optimizer) != snapshot:
                return ("an optimizer's parameters or hyperparameters changed (e.g. a scheduler's lr: each "
                        "new value is a new capture, a program input only in a later version)")
        if tuple(_requires_grad(self.params)) != self.requires_grad:
            return "a parameter was replaced, or its requires_grad toggled"
        return None


@dataclasses.dataclass
class _Program:
    """One captured step: its cached program, its inputs' sources, and where its outputs go."""

    graph_hash: bytes
    guards: _Guards
    # Per program input: (_ARG, flat argument index) | (_STATE, weakref to the tensor) | (_CONSTANT, tensor).
    sources: list[tuple[int, Any]]
    # Where, among the program's outputs, the tensors below take their values: the state tensors the step
    # writes in place, then new .grad (by parameter), then results.
    places: list[int]
    writes: list[weakref.ref[torch.Tensor]]
    grads: list[weakref.ref[torch.Tensor]]
    result: pytree.TreeSpec
    # Per leaf of the result: its output index, or the leaf itself (not a pending tensor).
    result_leaves: list[tuple[bool, Any]]
    # The values the last replay replaced, released at the next (see run).
    held: list = dataclasses.field(default_factory=list)

    def run(self, flat_args: Sequence[Any]) -> Any:
        """One replay: the program on the current inputs, its outputs given to the tensors they replace."""
        inputs = []
        for kind, source in self.sources:
            if kind == _ARG:
                inputs.append(flat_args[source])
            elif kind == _STATE:
                t = source()
                if t is None:
                    raise _Stale("a tensor the step reads was freed")
                inputs.append(t)
            else:
                inputs.append(source)
        if any(_private.need_materialization([_private.inner_value(t) for t in inputs])):
            # Written between calls (a hand-made update, a pending batch): synced first, as a traced step would.
            log.debug("replayed step: pending inputs synced before the replay")
            torch_xla.sync()
        writes = [ref() for ref in self.writes]
        params = [ref() for ref in self.grads]
        if None in writes or None in params:
            raise _Stale("a tensor the step writes was freed")
        # Releasing buffers costs host time (PJRT CPU: released while this replay's execution ran, they
        # cost about a whole step, measured). The values the last replay replaced are released here,
        # before this one launches (the device has had the time between calls); the values this one
        # replaces, its inputs, are held until the next. (Donating them instead, as the traced step does,
        # measured slower here: 19 ms per replay on bench's mlp32x256, against under 10.)
        self.held = []
        outputs = _private.run_cached_graph(self.graph_hash, inputs)
        outputs = [outputs[i] for i in self.places]
        self.held = [_private.inner_value(t) for t in writes] + [p.grad for p in params]
        for t, value in zip(writes, outputs):
            _private.restore_value(t, _private.inner_value(value))
        # Each tensor's functional storage takes the new value too: views (detach, .data) read it.
        _private.settle(writes)
        for p, grad in zip(params, outputs[len(writes):]):
            p.grad = grad
        first = len(writes) + len(params)
        counting.bump(REPLAY_COUNTER)
        leaves = [outputs[first + v] if is_output else v for is_output, v in self.result_leaves]
        return pytree.tree_unflatten(leaves, self.result)


class _Stale(Exception):
    """A capture no longer fits the live state."""


class ReplayedStep:
    """A training step, traced for ``WARMUP_CALLS`` calls, then captured and replayed (see the module)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls = 0
        self.captures = 0
        self.replays = 0
        # Why the step is always traced, once it is (None while it may replay).
        self.traced_because: Optional[str] = None
        self._program: Optional[_Program] = None

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        flat, _ = pytree.tree_flatten(args)
        key = _args_key(flat)
        program = self._program
        if program is not None:
            cause = program.guards.failed(key)
            if cause is None:
                try:
                    out = program.run(flat)
                    self.replays += 1
                    return out
                except _Stale as stale:
                    cause = str(stale)
            self._program = None
            _warn_once(self.fn, f"traced again: {cause}")
        if self.traced_because is not None or self.calls <= WARMUP_CALLS:
            return self.fn(*args)
        if self.captures >= MAX_CAPTURES:
            self._always_trace(f"captured {MAX_CAPTURES} times: what changes between calls should be an input")
            return self.fn(*args)
        return self._capture(args, flat, key)

    def _always_trace(self, cause: str) -> None:
        self.traced_because = cause
        _warn_once(self.fn, f"not replayed, traced on every call: {cause}")

    def _capture(self, args: tuple, flat: list, key: tuple) -> Any:
        """Traces one call with executions held back, captures its program, then cuts the step as usual
        (this call executes as a traced one does; the next call replays)."""
        if xr.is_spmd():
            self._always_trace("SPMD steps are not replayed yet")
            return self.fn(*args)
        # Nothing pending before: what is pending after is this step's. A barrier advances the RNG seed: this
        # one, which a traced call does not have, leaves it as it was (dropout draws what a traced call draws).
        seed = _private.rng_seed()
        torch_xla.sync()
        _private.set_rng_seed(seed)
        xm.wait_device_ops()
        state, optimizers = _training_state()
        old_grads = {id(p): p.grad for p in state if p.is_leaf and p.requires_grad}
        # The state's values now, held while the call is traced: their buffers are not freed (and their
        # addresses not reused) before the program's inputs are matched to them.
        old = [_private.inner_value(t) for t in state]
        arg_ids = {_private.tensor_id(_private.inner_value(a)): i for i, a in enumerate(flat)
                   if isinstance(a, torch.Tensor) and a.is_xla}
        closures = len(_private.step_closures())
        _private.set_allow_execution(False)
        try:
            out = self.fn(*args)
        finally:
            _private.set_allow_execution(True)
        self.captures += 1
        counting.bump(REPLAY_CAPTURE_COUNTER)
        program, cause = None, None
        if _private.rng_seed() != seed:
            cause = "the step draws random numbers (dropout): a replay would draw the same ones"
        elif not all(map(_private.is_own_step_closure, _private.step_closures()[closures:])):
            cause = "the step adds step closures (xm.add_step_closure), which run only where a step is cut"
        else:
            program, cause = _program_of(out, flat, key, state, old, old_grads, optimizers, arg_ids)
        del old
        # This call's step, cut as a traced one is (one execution; its closures run).
        fused_step.end_step()
        if program is None:
            self._always_trace(cause)
        else:
            self._program = program
        return out


def _program_of(out: Any, flat: list, key: tuple, state: list[torch.Tensor], old: list[torch.Tensor],
                old_grads: dict[int, Optional[torch.Tensor]], optimizers: list[torch.optim.Optimizer],
                arg_ids: dict[int, int]) -> tuple[Optional["_Program"], str]:
    """The captured program of a call traced with executions held back, or None and why it cannot be replayed.

    ``state``: the module and optimizer tensors, ``old`` their values before the call (held), ``old_grads``
    each parameter's ``.grad`` then; ``arg_ids``: the lazy tensor id of each tensor argument's value then.
    """
    known = {id(t) for t in state}
    by_id = {_private.tensor_id(v): t for v, t in zip(old, state)}
    tensor_args = [(i, a) for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.is_xla]
    result_flat, result_spec = pytree.tree_flatten(out)
    results = [t for t in result_flat if isinstance(t, torch.Tensor) and t.is_xla and id(t) not in known]
    pending_state = [t for t, p in zip(*_pending(state)) if p]
    params = [p for p in state if id(p) in old_grads]
    grad_params = [p for p in params if p.grad is not None and id(p.grad) not in known]
    results = [t for t, p in zip(*_pending(results)) if p]
    accounted = {id(t) for t in (*pending_state, *results)} | {id(p.grad) for p in grad_params}
    # Pending tensors the step left that are none of these: a Python side effect (a loss kept in a list).
    # Values only the step's own machinery holds (its backward's raw gradients, held from C++) are left out.
    gc.collect()
    live = _live_xla_tensors()
    pending_live = [t for t, p in zip(*_pending(live)) if p]
    others = [t for t in pending_live if id(t) not in accounted]
    # (A list, not a generator: a running generator refers to its item.)
    count = len([t for t in others if _held_by_python(t, ignore=(live, pending_live, others))])
    if count:
        return None, (f"the step leaves {count} pending tensors that are neither state it writes nor its "
                      "result (e.g. losses kept in a list inside the step)")
    # The program is the one the call's own cut compiles (the same outputs, in the order torch_xla syncs live
    # tensors: by lazy tensor id), so that a replay computes what the traced call does, bitwise; the outputs
    # only the step's machinery holds are computed and dropped, as there.
    outputs = [*pending_state, *(p.grad for p in grad_params), *results]

    def lazy_id(t: torch.Tensor) -> int:
        return _private.tensor_id(_private.inner_value(t))

    # One output per lazy tensor (wrappers of one lazy tensor share it).
    program = sorted({lazy_id(t): t for t in (*pending_live, *outputs)}.values(), key=lazy_id)
    position = {lazy_id(t): i for i, t in enumerate(program)}
    places = [position[lazy_id(t)] for t in outputs]
    inner = [_private.inner_value(t) for t in program]
    del live, pending_live, others, program
    ids, values = _private.program_inputs(inner)
    handles = dict(zip(_handles(old), state))
    arg_handles = dict(zip(_handles([a for _, a in tensor_args]), (i for i, _ in tensor_args)))
    sources: list[tuple[int, Any]] = []
    for tensor_id, value, handle in zip(ids, values, _handles(values)):
        if tensor_id in arg_ids or handle in arg_handles:
            sources.append((_ARG, arg_ids.get(tensor_id, arg_handles.get(handle))))
        elif tensor_id in by_id or handle in handles:
            sources.append((_STATE, weakref.ref(by_id.get(tensor_id, handles.get(handle)))))
        elif value.dim() == 0:
            sources.append((_CONSTANT, value))  # a Python number of the trace, uploaded
        else:
            return None, (f"the step reads a tensor of shape {tuple(value.shape)} that is neither an argument, "
                          "a module's parameter or buffer, nor optimizer state: pass it as an argument")
    launched = counting.launches()
    graph_hash = _private.cache_program(inner)
    # Compiled, not run: no launch in the step (the fused step would take it for a read; see counting.launches).
    _private.increment_counter(VALIDATION_COUNTER, counting.launches() - launched)
    leaves: list[tuple[bool, Any]] = []
    index = {id(t): i for i, t in enumerate(results)}
    for leaf in result_flat:
        leaves.append((True, index[id(leaf)]) if id(leaf) in index else (False, leaf))
    guards = _Guards(key, [(weakref.ref(o), _optimizer_snapshot(o)) for o in optimizers],
                     [weakref.ref(p) for p in params], tuple(_requires_grad(params)))
    log.debug("replayed step captured: %d inputs (%d arguments, %d constants), %d writes, %d new .grad, "
              "%d results", len(sources), sum(k == _ARG for k, _ in sources),
              sum(k == _CONSTANT for k, _ in sources), len(pending_state), len(grad_params), len(results))
    return _Program(graph_hash, guards, sources, places, [weakref.ref(t) for t in pending_state],
                    [weakref.ref(p) for p in grad_params], result_spec, leaves), ""


def _held_by_python(t: torch.Tensor, ignore: Sequence[list]) -> bool:
    """Whether a Python object other than the lists in ``ignore`` (and frames) refers to ``t``."""
    return any(not (any(r is i for i in ignore) or isinstance(r, types.FrameType)) for r in gc.get_referrers(t))


def _handles(tensors: Sequence[torch.Tensor]) -> list[int]:
    return _private.buffer_handles([_private.inner_value(t) for t in tensors]) if tensors else []


def _pending(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[bool]]:
    return tensors, _private.need_materialization([_private.inner_value(t) for t in tensors])


def _live_xla_tensors() -> list[torch.Tensor]:
    """Live XLA tensors that hold a lazy tensor (plain tensors and parameters; not dynamo's fakes)."""
    out = []
    for t in _private.live_objects(torch.Tensor):
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_xla and _private.holds_lazy_tensor(t):
            out.append(t)
    return out


def _training_state() -> tuple[list[torch.Tensor], list[torch.optim.Optimizer]]:
    """The XLA tensors of live modules (parameters, their ``.grad``, buffers) and of live optimizers (state,
    tensor hyperparameters), and those optimizers. Found through their owners, not by walking every tensor:
    a tensor only C++ keeps alive must not gain a Python reference (torch then warns, and its object dies
    under the reference)."""
    tensors: dict[int, torch.Tensor] = {}
    for module in _private.live_objects(torch.nn.Module):
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            tensors[id(t)] = t
            if t.grad is not None:
                tensors[id(t.grad)] = t.grad
    optimizers = []
    for optimizer in _private.live_objects(torch.optim.Optimizer):
        owned = [*(v for st in optimizer.state.values() for v in st.values()),
                 *(v for g in optimizer.param_groups for k, v in g.items() if k != "params")]
        held = [v for v in owned if isinstance(v, torch.Tensor)]
        if any(id(p) in tensors for g in optimizer.param_groups for p in g["params"]):
            optimizers.append(optimizer)
            tensors.update((id(t), t) for t in held)
    return [t for t in tensors.values() if t.is_xla and _private.holds_lazy_tensor(t)], optimizers


def _args_key(flat: Sequence[Any]) -> tuple:
    return tuple((a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a) for a in flat)


def _optimizer_snapshot(optimizer: torch.optim.Optimizer) -> tuple:
    """Its parameters' identities and hyperparameters; a tensor hyperparameter by identity and version (an
    in-place update, a scheduler's, changes it: a CPU tensor's value is a constant of the trace)."""
    return tuple((tuple(map(id, g["params"])),
                  tuple((k, ("tensor", id(v), v._version) if isinstance(v, torch.Tensor) else v)
                        for k, v in g.items() if k != "params"))
                 for g in optimizer.param_groups)


def _requires_grad(params: Sequence[Any]) -> list[Optional[bool]]:
    """Each parameter's requires_grad (None where a weakly held one died)."""
    tensors = [p() if isinstance(p, weakref.ref) else p for p in params]
    return [None if t is None else t.requires_grad for t in tensors]


@functools.cache
def _warn_once_cached(name: str, message: str) -> None:
    warnings.warn(f"{STEP_BACKEND_NAME} replayed step {name}: {message}", stacklevel=3)


def _warn_once(fn: Callable[..., Any], message: str) -> None:
    _warn_once_cached(getattr(fn, "__qualname__", repr(fn)), message)
