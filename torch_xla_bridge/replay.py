"""A training step handed over whole and replayed: ``@torch_xla_bridge.replayed_step``.

The drop-in fused step traces every step again (forward, backward,
optimizer), because nothing tells it that the next step is the same. A
function decorated with :func:`replayed_step` says so: it is the whole step
(forward, backward, optimizer step, ``zero_grad``), its batch comes in as
arguments, and it reads and writes the same tensors every call. After
``WARMUP_CALLS`` ordinary calls (the first creates the optimizer's state),
one call is traced and, if nothing executed while it was, captured: the program
its cut compiles (every pending tensor, in torch_xla's order, so the very
program a traced call runs), where each input comes from (an argument by
position, a module's or optimizer's tensor by reference, or a Python
number of the trace), and which outputs become the state it writes, new
``.grad`` and its results; then the step is cut as usual, and the tensors
it writes are packed into flat buffers, each a view of its part. From then
on a call checks its guards, runs one cached program on the flat buffers
and the arguments (torch_xla's ``_run_cached_graph``, as its dynamo bridge
replays an inference graph) and gives each flat buffer its new value: no
tracing, no autograd engine, no walk of live tensors, no work per tensor
but the guards.

Invariants: a replay computes what tracing the call computes, bitwise (the
traced program, embedded as a conditional's branch so XLA fuses it alike,
checked at capture against the traced call; where it differs, the traced
program itself, unpacked);
a call whose guards fail unpacks the state and is traced again (counted,
warned once per cause) and captured anew, at most ``MAX_CAPTURES`` times,
after which the step is always traced; what cannot be replayed safely (a
step that draws random numbers, adds step closures, changes optimizer
state kept on the host, keeps pending tensors outside its state and
results, reads a tensor from outside) is traced on every call, with one
warning naming the cause. Under SPMD the state is not packed (a flat buffer
cannot carry each tensor's sharding): the replay runs the traced program
itself, partitioned as torch_xla compiles it, and gives each written tensor
its output. The decorated function holds its
program and flat buffers, and, weakly, the tensors it reads and writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import types
import warnings
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.utils._pytree as pytree
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr

from . import _private, counting, deferred, fused_step, host_tape
from .names import (REPLAY_CAPTURE_COUNTER, REPLAY_CHECK_COUNTER, REPLAY_COUNTER, REPLAY_PACK_COUNTER,
                    REPLAY_PROGRAM_NAME, REPLAY_RETRACE_CAUSES, REPLAY_UNPACK_COUNTER, RETRACE_ARGUMENTS, RETRACE_FREED, RETRACE_GRAD,
                    RETRACE_MODULES, RETRACE_OPTIMIZER, RETRACE_REQUIRES_GRAD, RETRACE_STATE, RETRACE_TRAINING,
                    STEP_BACKEND_NAME, VALIDATION_COUNTER)

log = logging.getLogger(__name__)

# Ordinary calls before the first capture: the first creates the optimizer's state, the second is steady.
WARMUP_CALLS = 2
# Captures per decorated function (the first included) before it is always traced.
MAX_CAPTURES = 8
# Captures in a row invalidated before their first replay (what they assumed changes every call: a float lr a
# scheduler sets) before it is always traced: each cost a capture and gave nothing.
UNREPLAYED_CAPTURES = 2

# Where a replayed program's input comes from.
_FLAT, _ARG, _STATE, _CONSTANT, _HOST = 0, 1, 2, 3, 4


def replayed_step(fn: Callable[..., Any]) -> "ReplayedStep":
    """Decorates a whole training step to be replayed after warm-up (see the module).

    ``fn`` trains with ``openxla_fused_step`` (its model compiled with it) and
    does the whole step: forward, backward, optimizer step, ``zero_grad``.
    Its tensor arguments (the batch) may change value between calls; a new
    shape or dtype, or a changed non-tensor argument, is a new capture.
    """
    return functools.wraps(fn)(ReplayedStep(fn))


@dataclasses.dataclass(eq=False)  # hashed by identity: watched in a WeakSet
class _Guards:
    """What a capture assumed, checked on every call: identities, shapes, Python numbers (no tensor is read)."""

    args: tuple
    # Per optimizer: its parameters' identities and its hyperparameters (everything but the params).
    optimizers: list[tuple[weakref.ref[torch.optim.Optimizer], tuple]]
    # Each trained parameter's requires_grad.
    params: list[weakref.ref[torch.Tensor]]
    requires_grad: tuple
    # Each packed .grad and the parameter it belongs to (p.grad is still that tensor).
    grads: list[tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]]
    # Each optimizer state tensor the step reads or writes: (optimizer, parameter, key, tensor).
    states: list[tuple[weakref.ref, weakref.ref, str, weakref.ref]]
    # Set by a registration hook when a parameter, buffer or submodule is registered into (or replaced in) a
    # module the step reads from (see _watch_modules).
    modules_changed: bool = False
    # Those modules and their training flag (``model.eval()`` changes what the forward computes).
    training: list[tuple[weakref.ref[torch.nn.Module], bool]] = dataclasses.field(default_factory=list)
    # The tensor hyperparameters that are program inputs (host_tape): guarded by identity, not version.
    host_inputs: frozenset[int] = frozenset()

    def failed(self, args: tuple) -> Optional[str]:
        """Why this call cannot replay the capture (a key of ``REPLAY_RETRACE_CAUSES``), or None."""
        if args != self.args:
            return RETRACE_ARGUMENTS
        if self.modules_changed:
            return RETRACE_MODULES
        if any(m() is None or m().training != flag for m, flag in self.training):
            return RETRACE_TRAINING
        for ref, snapshot in self.optimizers:
            optimizer = ref()
            if optimizer is None or _optimizer_snapshot(optimizer, self.host_inputs) != snapshot:
                return RETRACE_OPTIMIZER
        if tuple(_requires_grad(self.params)) != self.requires_grad:
            return RETRACE_REQUIRES_GRAD
        for p, g in self.grads:
            param = p()
            if param is None or param.grad is not g() or param.grad is None:
                return RETRACE_GRAD
        for o, p, key, t in self.states:
            optimizer, param = o(), p()
            state = None if optimizer is None or param is None else optimizer.state.get(param)
            if state is None or state.get(key) is not t() or state.get(key) is None:
                return RETRACE_STATE
        return None


@dataclasses.dataclass
class _Program:
    """One captured step: its cached program, where its inputs come from and where its outputs go.

    The tensors the step writes (parameters, optimizer state, ``.grad``) are
    packed, once captured, into one flat buffer per dtype (``flats``), each a
    view of its part: a replay reads the flat buffers and gives each its new
    value, so its host cost does not grow with the number of tensors; a view
    sees its new value when read (functionalization regenerates it then).
    """

    graph_hash: bytes
    guards: _Guards
    # Per program input, in the program's order: (_FLAT, index in flats) | (_ARG, flat argument index) |
    # (_STATE, weakref to the tensor) | (_CONSTANT, tensor) | (_HOST, index of host's values).
    sources: list[tuple[int, Any]]
    # The written tensors of each flat buffer, in the buffer's order; packed by pack().
    groups: list[list[weakref.ref[torch.Tensor]]]
    result: pytree.TreeSpec
    # Per leaf of the result: its output index (after the flat buffers), or the leaf itself (not a pending tensor).
    result_leaves: list[tuple[bool, Any]]
    # Values the host computes from tensor hyperparameters (a scheduler's lr), transferred per replay.
    host: Optional[host_tape.HostInputs] = None
    # Unpacked (under SPMD, see _unpacked_program): each written tensor and its output index.
    writes: list[tuple[weakref.ref[torch.Tensor], int]] = dataclasses.field(default_factory=list)
    flats: list[torch.Tensor] = dataclasses.field(default_factory=list)
    replays: int = 0

    def pack(self) -> None:
        """Packs each group's current values into its flat buffer (one execution) and makes every member a view
        of its part (``.data``: the same tensor objects, parameters stay leaves)."""
        members = self._members()
        if not members:  # unpacked
            return
        with torch.no_grad():
            self.flats = [torch.cat([t.detach().reshape(-1) for t in group]) for group in members]
        counting.bump(REPLAY_PACK_COUNTER)
        torch_xla.sync()
        for flat, group in zip(self.flats, members):
            offset = 0
            for t in group:
                t.data = flat[offset:offset + t.numel()].view(t.shape)
                offset += t.numel()

    def _members(self) -> list[list[torch.Tensor]]:
        """The written tensors of each flat buffer; :class:`_Stale` if one was freed."""
        members = [[ref() for ref in group] for group in self.groups]
        if any(t is None for group in members for t in group):
            raise _Stale(RETRACE_FREED)
        return members

    def unpack(self) -> None:
        """Gives every member a value of its own again, out of the flat buffers (one execution): a traced call
        then sees the tensors the capture found."""
        if not self.flats:
            return
        members = [t for group in self.groups for t in (ref() for ref in group) if t is not None]
        with torch.no_grad():
            for t in members:
                t.data = t.detach().clone()
        self.flats = []
        counting.bump(REPLAY_UNPACK_COUNTER)
        torch_xla.sync()

    def shadow(self, flat_args: Sequence[Any], old: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """Before the capture call's cut: the packed program run on the state as it was before the call
        (``old``: each written tensor's value then, by id; zeros for one the step only writes), for
        :meth:`matches` to compare with what the traced call computes (two executions, at capture only)."""
        with torch.no_grad():
            flats = [torch.cat([old[id(t)].reshape(-1) if id(t) in old else
                                torch.zeros(t.numel(), dtype=t.dtype, device=t.device)
                                for t in (ref() for ref in group)]) for group in self.groups]
        inputs = self._inputs(flats, flat_args)
        # The old flat buffers, and any input still pending (the predicate), computed first: one execution.
        inner = [_private.inner_value(t) for t in inputs]
        counting.bump(REPLAY_CHECK_COUNTER)
        _private.XLAC._xla_sync_multi([t for t, p in zip(inner, _private.need_materialization(inner)) if p],
                                      devices=[], wait=False)
        counting.bump(REPLAY_CHECK_COUNTER)
        return _private.run_cached_graph(self.graph_hash, inputs)

    def matches(self, shadow: list[torch.Tensor], results: Sequence[torch.Tensor]) -> bool:
        """Whether the shadow run's outputs are, bit for bit (NaN as NaN), the state and the results the traced
        call computed (after its cut, before :meth:`pack`; one execution). XLA may compile the program embedded
        in the replayed one otherwise than alone (seen: a ResNet-18 step, 1e-7 apart)."""
        with torch.no_grad():
            expected = [*(torch.cat([t.detach().reshape(-1) for t in group]) for group in self._members()),
                        *results]
            same = [((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b).all()
                    for a, b in zip(shadow, expected)]
            if not same:
                return True
            ok = torch.stack(same).all()
            # Executed through a sync (explain tells it by the counter), then read without executing.
            counting.bump(REPLAY_CHECK_COUNTER)
            _private.XLAC._xla_sync_multi([ok], devices=[], wait=True)
            return bool(ok.item())

    def _inputs(self, flats: Sequence[torch.Tensor], flat_args: Sequence[Any]) -> list[Any]:
        inputs = []
        host = self.host.values() if self.host is not None else []
        for kind, source in self.sources:
            if kind == _FLAT:
                inputs.append(_private.inner_value(flats[source]))
            elif kind == _ARG:
                inputs.append(flat_args[source])
            elif kind == _HOST:
                inputs.append(host[source])
            elif kind == _STATE:
                t = source()
                if t is None:
                    raise _Stale(RETRACE_FREED)
                inputs.append(t)
            else:
                inputs.append(source)
        return inputs

    def run(self, flat_args: Sequence[Any]) -> Any:
        """One replay: the program on the current inputs, the flat buffers given their new values."""
        # A view written since (a load_state_dict's copy_) is applied to its flat buffer now.
        _private.settle(self.flats)
        inputs = self._inputs(self.flats, flat_args)
        if any(_private.need_materialization([_private.inner_value(t) for t in inputs])):
            # Written between calls (a hand-made update, a pending batch): synced first, as a traced step would.
            log.debug("replayed step: pending inputs synced before the replay")
            torch_xla.sync()
        counting.bump(REPLAY_COUNTER)  # before the execution: explain tells a replay by it
        outputs = _private.run_cached_graph(self.graph_hash, inputs)
        for flat, value in zip(self.flats, outputs):
            _private.restore_value(flat, _private.inner_value(value))
        _private.settle(self.flats)
        written = [(ref(), k) for ref, k in self.writes]
        for t, k in written:
            if t is not None:
                _private.restore_value(t, _private.inner_value(outputs[k]))
        _private.settle([t for t, _ in written if t is not None])
        first = len(self.flats)
        leaves = [outputs[first + v] if is_output else v for is_output, v in self.result_leaves]
        return pytree.tree_unflatten(leaves, self.result)


class _Stale(Exception):
    """A capture no longer fits the live state (its argument: a key of ``REPLAY_RETRACE_CAUSES``)."""


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
        self._warned: set[str] = set()
        self._unreplayed = 0  # captures in a row invalidated before their first replay
        # Whether a capture packs the state it writes; False once a packed program failed its check against the
        # traced call (see _Program.matches): later captures replay the traced program itself, unpacked.
        self.packed = True

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        flat, _ = pytree.tree_flatten(args)
        key = _args_key(flat)
        program = self._program
        retraced: Optional[str] = None
        if program is not None:
            retraced = program.guards.failed(key)
            if retraced is None:
                try:
                    out = program.run(flat)
                    self.replays += 1
                    program.replays += 1
                    return out
                except _Stale as stale:
                    retraced = str(stale)
            self._program = None
            program.unpack()
            self._warn(f"traced again: {REPLAY_RETRACE_CAUSES[retraced]}")
            self._unreplayed = 0 if program.replays else self._unreplayed + 1
            if self._unreplayed >= UNREPLAYED_CAPTURES and self.traced_because is None:
                self._always_trace(f"{self._unreplayed} captures in a row were traced again before their first "
                                   f"replay, as {REPLAY_RETRACE_CAUSES[retraced]}: what changes every call should "
                                   "be an input")
        if self.traced_because is not None or self.calls <= WARMUP_CALLS or self.captures >= MAX_CAPTURES:
            if self.traced_because is None and self.captures >= MAX_CAPTURES:
                self._always_trace(f"captured {MAX_CAPTURES} times: what changes between calls should be an input")
            if retraced is not None:
                counting.bump(retraced)
            return self.fn(*args)
        return self._capture(args, flat, key, retraced)

    def _always_trace(self, cause: str) -> None:
        self.traced_because = cause
        self._warn(f"not replayed, traced on every call: {cause}")

    def _warn(self, message: str) -> None:
        """Warns once per message and decorated step."""
        if message not in self._warned:
            self._warned.add(message)
            name = getattr(self.fn, "__qualname__", repr(self.fn))
            warnings.warn(f"{STEP_BACKEND_NAME} replayed step {name}: {message}", stacklevel=3)

    def _capture(self, args: tuple, flat: list, key: tuple, retraced: Optional[str]) -> Any:
        """Traces one call (nothing may execute inside it), captures its program, then cuts the step as usual
        (this call executes as a traced one does, then packs the state it writes; the next call replays).
        ``retraced``: why the call before was not a replay, if it was one (bumped where explain sees it)."""
        # Nothing pending before: what is pending after is this step's. A barrier advances the RNG seed: this
        # one, which a traced call does not have, leaves it as it was (dropout draws what a traced call draws).
        seed = _private.rng_seed()
        torch_xla.sync()
        _private.set_rng_seed(seed)
        xm.wait_device_ops()
        state, optimizers, modules = _training_state()
        old_grads = {id(p): p.grad for p in state if p.is_leaf and p.requires_grad}
        # The state's values now, held while the call is traced: their buffers are not freed (and their
        # addresses not reused) before the program's inputs are matched to them.
        old = [_private.inner_value(t) for t in state]
        closures = len(_private.step_closures())
        host_state = _host_state(optimizers)
        hyperparameters = [_optimizer_snapshot(o) for o in optimizers]
        # The fused step's own cut is left to this call; executions are not held back (torch_xla would fail
        # the call at a read inside the step): one launched while the step is traced tells a step that is not
        # one program, and this call goes on as a traced one.
        launched = counting.launches()
        with fused_step.cut_by_caller(), host_tape.recording(optimizers) as tape, _compiled_transfers_noted(tape):
            out = self.fn(*args)
        self.captures += 1
        counting.bump(REPLAY_CAPTURE_COUNTER)
        program, cause = None, None
        if counting.launches() != launched:
            cause = ("the step executes inside it (a value read on the host, e.g. loss.item() or print(loss), or "
                     "a sync): a replay would not run its Python; read values after the call")
        elif _private.rng_seed() != seed:
            cause = "the step draws random numbers (dropout): a replay would draw the same ones"
        elif not all(map(_private.is_own_step_closure, _private.step_closures()[closures:])):
            cause = "the step adds step closures (xm.add_step_closure), which run only where a step is cut"
        elif _host_state(optimizers) != host_state:
            cause = ("the step changes optimizer state kept on the host (e.g. Adam's step count, a CPU tensor "
                     "unless capturable=True), which a replay would leave as it was")
        elif [_optimizer_snapshot(o) for o in optimizers] != hyperparameters:
            cause = ("the step changes an optimizer's hyperparameters (a scheduler stepped inside it), which a "
                     "replay would leave as they were: step the scheduler outside the decorated step")
        else:
            program, cause = _program_of(out, flat, key, state, old, old_grads, optimizers, modules, tape,
                                         packed=self.packed)
        # A packed program run on the state before the call (before the cut donates its buffers), to be compared
        # with what the call computes. Its launches are this capture's, not a read inside the step: discounted
        # as the fused step's launch count discounts a compile that runs nothing (see counting.launches).
        shadow = None
        if program is not None and program.groups:
            launched = counting.launches()
            shadow = program.shadow(flat, {id(t): v for t, v in zip(state, old)})
            _private.increment_counter(VALIDATION_COUNTER, counting.launches() - launched)
        del old
        if retraced is not None:  # after the capture's own barrier: explain reads it at the cut
            counting.bump(retraced)
        # This call's step, cut as a traced one is (one execution; its closures run).
        fused_step.end_step()
        if program is None:
            self._always_trace(cause)
            return out
        try:
            if shadow is not None:
                # The call's results in the order of the program's result outputs.
                by_output = {i: leaf for leaf, (is_output, i) in zip(pytree.tree_flatten(out)[0], program.result_leaves)
                             if is_output}
                if not program.matches(shadow, [by_output[i] for i in range(len(by_output))]):
                    # Not bitwise the traced call's: the next call captures the traced program itself, unpacked.
                    log.debug("replayed step: the packed program differs from the traced call; captured unpacked "
                              "next")
                    self.packed = False
                    return out
            program.pack()
        except _Stale as stale:
            self._always_trace(REPLAY_RETRACE_CAUSES[str(stale)])
            return out
        self._program = program
        return out


@contextlib.contextmanager
def _compiled_transfers_noted(tape: Optional[host_tape.Tape]) -> Iterator[None]:
    """While a capture traces: a compiled optimizer step's host scalars, stacked and transferred by its deferred
    graph (``deferred._Packed``), noted to the tape, which maps them to the tensor hyperparameters they are.
    The method is wrapped for the trace only (deferred stays as upstream's patch has it)."""
    if tape is None:
        yield
        return
    original = deferred._Packed.value

    def value(packed: deferred._Packed, args: Sequence[Any]) -> torch.Tensor:
        out = original(packed, args)
        tape.note_transfer(out, [args[i] for i in packed.positions])
        return out

    deferred._Packed.value = value
    try:
        yield
    finally:
        deferred._Packed.value = original


def _program_of(out: Any, flat: list, key: tuple, state: list[torch.Tensor], old: list[torch.Tensor],
                old_grads: dict[int, Optional[torch.Tensor]], optimizers: list[torch.optim.Optimizer],
                modules: list[torch.nn.Module], tape: Optional[host_tape.Tape], packed: bool = True
                ) -> tuple[Optional["_Program"], str]:
    """The captured program of a call traced with nothing executed, or None and why it cannot be replayed.

    ``state``: the module and optimizer tensors, ``old`` their values before the call (held), ``old_grads``
    each parameter's ``.grad`` then; ``modules``: the live modules; ``tape``: the host math on the optimizers'
    tensor hyperparameters, whose transfers become the program's host inputs.

    The program is the one the call's own cut compiles (the same outputs, in the order torch_xla syncs live
    tensors: by lazy tensor id), embedded in one that slices its state inputs out of the flat buffers and
    concatenates its state outputs into them (exact: slices and concatenation only), so that a replay computes
    what the traced call does, bitwise.
    """
    known = {id(t) for t in state}
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
    count = _held_by_python(others, ignore=(live, pending_live, others))
    if count:
        return None, (f"the step leaves {count} pending tensors that are neither state it writes nor its "
                      "result (e.g. losses kept in a list inside the step)")
    # What the step writes: state in place, new .grad; each member of its dtype's flat buffer.
    writes = [*pending_state, *(p.grad for p in grad_params)]
    if any(t.is_sparse or not t.is_contiguous() for t in writes):
        return None, "the step writes a sparse or non-contiguous tensor, which cannot be packed"

    def lazy_id(t: torch.Tensor) -> int:
        return _private.tensor_id(_private.inner_value(t))

    # One output per lazy tensor (wrappers of one lazy tensor share it), the outputs only the step's machinery
    # holds included: the very program of the traced call.
    program = sorted({lazy_id(t): t for t in (*pending_live, *writes, *results)}.values(), key=lazy_id)
    position = {lazy_id(t): i for i, t in enumerate(program)}
    inner = [_private.inner_value(t) for t in program]
    del live, pending_live, others, program
    xm.wait_device_ops()  # the buffers below are assigned (a handle in flight is a placeholder's)
    if xr.is_spmd() or not packed:
        return _unpacked_program(inner, position, flat, key, state, old, params, writes, results, result_flat,
                                 result_spec, known, optimizers, modules, tape)
    ctx = _private.LoweringContext("ReplayedStepBody")
    ctx.build(inner)
    body = _private.computation_from_module_proto("replayed_step_body", ctx.hlo())
    parameters = ctx.device_parameter_id_tensor_mapping()
    # Each parameter's source, by the buffer it reads: an argument first, then the state's values before the call.
    source_of: dict[int, tuple[int, Any]] = {}
    for i, a in enumerate(flat):
        if isinstance(a, torch.Tensor) and a.is_xla:
            source_of.setdefault(ctx.tensor_parameter_id(_private.inner_value(a)), (_ARG, i))
    for t, value in zip(state, old):
        source_of.setdefault(ctx.tensor_parameter_id(value), (_STATE, t))
    host = None
    if tape is not None:
        uploaded = {ctx.tensor_parameter_id(_private.inner_value(v)) for v, _ in tape.uploads}
        host = tape.inputs([parameters[pid] for pid in range(len(parameters))
                            if pid not in source_of and pid not in uploaded and parameters[pid].dim() == 0])
        for k, value in enumerate(host.uploads if host is not None else ()):
            source_of.setdefault(ctx.tensor_parameter_id(_private.inner_value(value)), (_HOST, k))
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in writes:
        groups.setdefault(t.dtype, []).append(t)
    packed = list(groups.values())
    where = {id(t): (g, offset) for g, group in enumerate(packed)
             for offset, t in zip(itertools.accumulate((t.numel() for t in group), initial=0), group)}

    xb = _private.xla_builder
    builder = xb.create_builder("replayed_step")
    sizes = [sum(t.numel() for t in group) for group in packed]
    inputs = [xb.mkparam(builder, g, xb.mkshape(xb.Op.from_torch_type(group[0].dtype), [n]))
              for g, (n, group) in enumerate(zip(sizes, packed))]
    placeholders = [_private.create_placeholder_tensor([n], group[0].dtype) for n, group in zip(sizes, packed)]
    sources: list[tuple[int, Any]] = [(_FLAT, g) for g in range(len(packed))]
    body_args = []
    host_vectors: dict[int, Any] = {}

    def add_input(kind: int, source: Any, value: torch.Tensor) -> Any:
        sources.append((kind, source))
        placeholders.append(_private.create_placeholder_tensor(list(value.shape), value.dtype))
        return xb.mkparam(builder, len(sources) - 1, xb.tensor_shape(placeholders[-1]))

    for pid in range(len(parameters)):
        value = parameters[pid]
        kind, source = source_of.get(pid, (None, None))
        if kind == _STATE and id(source) in where:
            g, offset = where[id(source)]
            body_args.append(inputs[g].slice_in_dim(offset, offset + source.numel(), 0).reshape(list(source.shape)))
            continue
        if kind == _HOST:
            v, j = host.layout[source]
            if v not in host_vectors:
                nodes, dtype, _, shape = host.vectors[v]
                host_vectors[v] = add_input(_HOST, v, torch.empty(shape if j is None else [len(nodes)], dtype=dtype,
                                                                  device="meta"))
            body_args.append(host_vectors[v] if j is None else host_vectors[v].slice_in_dim(j, j + 1, 0).reshape([]))
            continue
        if kind == _STATE:
            source = weakref.ref(source)
        elif kind is None:
            if value.dim() != 0:
                return None, (f"the step reads a tensor of shape {tuple(value.shape)} that is neither an argument, "
                              "a module's parameter or buffer, nor optimizer state: pass it as an argument")
            kind, source = _CONSTANT, value  # a Python number of the trace, uploaded
        body_args.append(add_input(kind, source, value))
    # The traced program runs as one branch of a conditional on a predicate given at run time (always true):
    # XLA compiles a branch on its own, so it fuses (and contracts multiply-adds) inside it as in the program
    # the traced call runs, not across the slices and concatenations around it (XLA:CPU removes optimization
    # barriers before fusing; a call is inlined). That keeps a replay bitwise.
    with torch.no_grad():
        true = torch.ones((), dtype=torch.bool, device=parameters[0].device if parameters else torch_xla.device())
    predicate = add_input(_CONSTANT, true, true)

    def taken(*args: Any) -> Any:
        return xb.Op.call(body, args)

    shapes = xb.tensor_shape(inner)  # the body's outputs, in its order

    def not_taken(*args: Any) -> Any:
        return [xb.Op.zero(args[0].builder(), s.dtype).broadcast(list(s.sizes)) for s in shapes]

    step = predicate.mkconditional(body_args, taken, not_taken)
    outputs = [xb.Op.concat_in_dim([step.get_tuple_element(position[lazy_id(t)]).reshape([t.numel()])
                                    for t in group], 0) for group in packed]
    outputs += [step.get_tuple_element(position[lazy_id(t)]) for t in results]
    computation = xb.Op.tuple(outputs).build("replayed_step")
    with torch.no_grad():
        lazy = _private.user_computation(REPLAY_PROGRAM_NAME, placeholders, computation)
    # The sources in the order of the cached program's inputs (torch_xla's, by its IR's device data).
    order = {_private.tensor_id(p): i for i, p in enumerate(placeholders)}
    ids, _ = _private.program_inputs(lazy)
    sources = [sources[order[i]] for i in ids]
    launched = counting.launches()
    graph_hash = _private.cache_program(lazy)
    # Compiled, not run: no launch in the step (the fused step would take it for a read; see counting.launches).
    _private.increment_counter(VALIDATION_COUNTER, counting.launches() - launched)
    del lazy, placeholders, inner
    leaves: list[tuple[bool, Any]] = []
    index = {id(t): i for i, t in enumerate(results)}
    for leaf in result_flat:
        leaves.append((True, index[id(leaf)]) if id(leaf) in index else (False, leaf))
    guards = _guards(key, optimizers, params, writes, known, state, modules,
                     host.relaxed if host is not None and host_vectors else frozenset())
    log.debug("replayed step captured: %d inputs (%d flat buffers, %d arguments, %d constants, %d host vectors), "
              "%d tensors written, %d results", len(sources), len(packed), sum(k == _ARG for k, _ in sources),
              sum(k == _CONSTANT for k, _ in sources), len(host_vectors), len(writes), len(results))
    if host is not None:
        host.forget()
    return _Program(graph_hash, guards, sources, [[weakref.ref(t) for t in group] for group in packed],
                    result_spec, leaves, host if host_vectors else None), ""


def _unpacked_program(inner: list[torch.Tensor], position: dict[int, int], flat: list, key: tuple,
                      state: list[torch.Tensor], old: list[torch.Tensor], params: list[torch.Tensor],
                      writes: list[torch.Tensor], results: list[torch.Tensor], result_flat: list,
                      result_spec: pytree.TreeSpec, known: set[int], optimizers: list[torch.optim.Optimizer],
                      modules: list[torch.nn.Module], tape: Optional[host_tape.Tape]
                      ) -> tuple[Optional["_Program"], str]:
    """Under SPMD: the traced program itself, its state not packed (one flat buffer cannot carry each tensor's
    sharding), so a replay gives each written tensor its output (a host cost per tensor written, no tracing).

    torch_xla compiles it as it compiles the traced call's cut (partitioned, with the tensors' shardings):
    the same program. Its inputs are matched to arguments and state by buffer (under SPMD a buffer's
    recorded tensor id changes whenever its tensor's IR is taken).
    """
    launched = counting.launches()
    graph_hash = _private.cache_program(inner)
    _private.increment_counter(VALIDATION_COUNTER, counting.launches() - launched)
    _, values = _private.program_inputs(inner)
    source_of: dict[int, tuple[int, Any]] = {}
    args = [(i, _private.inner_value(a)) for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.is_xla]
    for (i, _), handle in zip(args, _private.buffer_handles([v for _, v in args])):
        source_of.setdefault(handle, (_ARG, i))
    for t, handle in zip(state, _private.buffer_handles(old)):
        source_of.setdefault(handle, (_STATE, weakref.ref(t)))
    handles = _private.buffer_handles(values)
    host = None
    if tape is not None:
        # The tape's transfers, each its own input (as the traced program reads them; see host_tape).
        uploaded = set(_private.buffer_handles([v for v, _ in tape.uploads]))
        host = tape.inputs([v for v, h in zip(values, handles)
                            if h not in source_of and h not in uploaded and v.dim() == 0])
        if host is not None:
            host.packed = False
            for k, handle in enumerate(_private.buffer_handles(host.uploads)):
                source_of.setdefault(handle, (_HOST, k))
    sources: list[tuple[int, Any]] = []
    for value, handle in zip(values, handles):
        source = source_of.get(handle)
        if source is None:
            if value.dim() != 0:
                return None, (f"the step reads a tensor of shape {tuple(value.shape)} that is neither an argument, "
                              "a module's parameter or buffer, nor optimizer state: pass it as an argument")
            source = (_CONSTANT, value)  # a Python number of the trace
        sources.append(source)
    index = {id(t): position[_private.tensor_id(_private.inner_value(t))] for t in results}
    leaves = [(True, index[id(leaf)]) if id(leaf) in index else (False, leaf) for leaf in result_flat]
    host_inputs = host is not None and any(kind == _HOST for kind, _ in sources)
    guards = _guards(key, optimizers, params, writes, known, state, modules,
                     host.relaxed if host_inputs else frozenset())
    log.debug("replayed step captured unpacked (SPMD): %d inputs (%d from the host), %d tensors written, "
              "%d results", len(sources), sum(kind == _HOST for kind, _ in sources), len(writes), len(results))
    if host is not None:
        host.forget()
    return _Program(graph_hash, guards, sources, [], result_spec, leaves, host if host_inputs else None,
                    writes=[(weakref.ref(t), position[_private.tensor_id(_private.inner_value(t))])
                            for t in writes]), ""


def _guards(key: tuple, optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor],
            writes: Sequence[torch.Tensor], known: set[int], state: Sequence[torch.Tensor],
            modules: Sequence[torch.nn.Module], relaxed: frozenset[int]) -> _Guards:
    """The guards of a capture: ``key`` its arguments', ``writes`` the tensors it writes, ``known`` the ids of
    the state tensors, ``relaxed`` the tensor hyperparameters that are program inputs."""
    members = {id(t) for t in writes}
    guards = _Guards(
        key, [(weakref.ref(o), _optimizer_snapshot(o, relaxed)) for o in optimizers],
        [weakref.ref(p) for p in params], tuple(_requires_grad(params)),
        [(weakref.ref(p), weakref.ref(p.grad)) for p in params if p.grad is not None and id(p.grad) in members],
        [(weakref.ref(o), weakref.ref(p), k, weakref.ref(v)) for o in optimizers for p, st in o.state.items()
         for k, v in st.items() if isinstance(v, torch.Tensor) and id(v) in known],
        host_inputs=relaxed,
    )
    _watch_modules(guards, state, modules)
    return guards


# Modules a capture reads from -> the guards to fail when one of them registers or replaces a parameter, buffer
# or submodule (torch's global registration hooks, installed once). Keyed weakly: it lives as long as they do.
_watched: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def _on_registration(module: torch.nn.Module, name: str, value: Any) -> None:
    for guards in _watched.get(module, ()):
        guards.modules_changed = True


@functools.cache
def _install_registration_hooks() -> None:
    from torch.nn.modules import module as nn_module

    nn_module.register_module_parameter_registration_hook(_on_registration)
    nn_module.register_module_buffer_registration_hook(_on_registration)
    nn_module.register_module_module_registration_hook(_on_registration)


def _watch_modules(guards: _Guards, state: Sequence[torch.Tensor], modules: Sequence[torch.nn.Module]) -> None:
    """Fails ``guards`` when a live module holding any of ``state``, or one containing such a module, registers
    or replaces a parameter, buffer or submodule (``model.fc = nn.Linear(...)``, ``Sequential.append``), or
    changes its training flag."""
    _install_registration_hooks()
    ids = {id(t) for t in state}
    holders = {id(m) for m in modules
               if any(id(t) in ids for t in (*m._parameters.values(), *m._buffers.values()))}
    for m in modules:
        if any(id(sub) in holders for sub in m.modules()):
            _watched.setdefault(m, weakref.WeakSet()).add(guards)
            guards.training.append((weakref.ref(m), m.training))


def _held_by_python(tensors: list[torch.Tensor], ignore: Sequence[list]) -> int:
    """How many of ``tensors`` a Python object other than the lists in ``ignore`` (and frames) refers to.

    One scan of the heap for all of them (``gc.get_referrers`` walks every tracked object per call)."""
    if not tensors:
        return 0
    holders = [r for r in gc.get_referrers(*tensors)
               if not (any(r is i for i in ignore) or isinstance(r, types.FrameType))]
    ids = {id(t) for t in tensors}
    return len({id(x) for r in holders for x in gc.get_referents(r) if id(x) in ids})


def _pending(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[bool]]:
    return tensors, _private.need_materialization([_private.inner_value(t) for t in tensors])


def _live_xla_tensors() -> list[torch.Tensor]:
    """Live XLA tensors that hold a lazy tensor (plain tensors and parameters; not dynamo's fakes)."""
    out = []
    for t in _private.live_objects(torch.Tensor):
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_xla and _private.holds_lazy_tensor(t):
            out.append(t)
    return out


def _training_state() -> tuple[list[torch.Tensor], list[torch.optim.Optimizer], list[torch.nn.Module]]:
    """The XLA tensors of live modules (parameters, their ``.grad``, buffers) and of live optimizers (state,
    tensor hyperparameters), those optimizers, and the live modules. Found through their owners, not by
    walking every tensor: a tensor only C++ keeps alive must not gain a Python reference (torch then warns,
    and its object dies under the reference)."""
    tensors: dict[int, torch.Tensor] = {}
    modules = _private.live_objects(torch.nn.Module)
    for module in modules:
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
    return [t for t in tensors.values() if t.is_xla and _private.holds_lazy_tensor(t)], optimizers, modules


def _host_state(optimizers: Sequence[torch.optim.Optimizer]) -> tuple:
    """The optimizers' state that is not on the device: CPU tensors by identity and version, other values as
    they are. A step that changes it runs Python a replay does not run (it computes its constants from it)."""
    return tuple((id(p), k, (id(v), v._version) if isinstance(v, torch.Tensor) else v)
                 for o in optimizers for p, st in o.state.items() for k, v in st.items()
                 if not (isinstance(v, torch.Tensor) and v.is_xla))


def _args_key(flat: Sequence[Any]) -> tuple:
    """What a capture assumes of its arguments: each tensor's shape, dtype and device, and under SPMD its
    sharding (the program is compiled for it, as upstream's bridge checks its inputs' shardings); each other
    argument's type and value."""
    spmd = xr.is_spmd()
    return tuple((a.shape, a.dtype, a.device, _private.sharding_spec(a) if spmd and a.is_xla else None)
                 if isinstance(a, torch.Tensor) else (type(a), a) for a in flat)


def _optimizer_snapshot(optimizer: torch.optim.Optimizer, inputs: frozenset[int] = frozenset()) -> tuple:
    """Its parameters' identities and hyperparameters; a tensor hyperparameter by identity and version (an
    in-place update, a scheduler's, changes it: a CPU tensor's value is a constant of the trace), except one of
    ``inputs`` (ids), a program input: by identity, dtype and shape."""
    return tuple((tuple(map(id, g["params"])),
                  tuple((k, ("tensor", id(v), v.dtype, v.shape, None if id(v) in inputs else v._version)
                         if isinstance(v, torch.Tensor) else v)
                        for k, v in g.items() if k != "params"))
                 for g in optimizer.param_groups)


def _requires_grad(params: Sequence[Any]) -> list[Optional[bool]]:
    """Each parameter's requires_grad (None where a weakly held one died)."""
    tensors = [p() if isinstance(p, weakref.ref) else p for p in params]
    return [None if t is None else t.requires_grad for t in tensors]

