"""Gradient accumulation as one loop: a step's micro-batches folded into one XLA While.

Under ``openxla_fused_step`` every micro-batch of an accumulation loop
(``for x in micro_batches: (model(x) / K).backward()``, then ``opt.step()``)
embeds the same lowered forward and backward computations
(:mod:`torch_xla_bridge.deferred`) on other inputs, and the autograd engine
adds each backward's gradients into ``.grad``. Left as they are, the step's one
program inlines all K micro-batches, so its compile time and memory grow with K.

Here each embedded call of a step is recorded (its computation, its inputs,
its results weakly), and at the end of every backward pass from the second
micro-batch on, the micro-batches so far are folded: one While loop whose body
calls the same computations once, on the inputs that differ between
micro-batches stacked along a new first dimension (sliced per iteration), the
inputs with one value in every micro-batch passed once, and a
backward's inputs that are results of the micro-batch's own calls wired
inside the body. Every ``.grad`` the backward accumulated into then takes the
loop's sum, computed as the engine computes it (``.grad`` before the first
micro-batch, then ``+`` each micro-batch's gradients in order; the first
stored as it is where ``.grad`` was None), so the values are the unrolled
step's, and whatever reads ``.grad`` later (``clip_grad_norm_``, the
optimizer) reads the loop. The forward's results still alive when the
optimizer step begins (the losses a loop keeps) take their values from the
same loop (:meth:`Accumulation.finish`): stacked where several micro-batches'
are alive, the last iteration's where only the last one's is.

Invariants: a fold changes no value: the gradients and the results it gives
out are computed by the same computations on the same inputs, summed in the
engine's order; it happens only where each micro-batch of a group made the
same calls with the same wiring, at least twice in a row, with no execution
in between (a read executes what it reads: the micro-batches after it form a
new group), so the program holds one loop per group of alike micro-batches
(a smaller last micro-batch: two), never one copy per micro-batch of that
group. Where folding cannot hold the step stays unrolled, as before, with
one warning naming why. A value computed lazily from a micro-batch's loss
before the step ends (``total += loss.detach()``) keeps reading that
micro-batch's own forward, computed in the step beside the loop.

State lives in :class:`Accumulation`, one per pending step of the fused
step (it dies with the step at the step barrier); the only module state is
:data:`_loops`, a cache of built loop computations by their layout.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Any, Optional, Sequence

import torch
from torch.utils.weak import WeakIdRef  # dereferenced with _fix_weakref, as a tensor's weak reference must be

from . import _private, counting, grad_sync
from .deferred import Embedded
from .names import (
    ACCUMULATION_LOOP_NAME, FOLD_COUNTER, STEP_BACKEND_NAME, UNFOLDED_COUNTER, USER_COMPUTATION_NAME,
)

log = logging.getLogger(__name__)

# Where an input of a call comes from: a result of an earlier call of the same micro-batch
# (call index, result index), or from outside (None).
_Wire = Optional[tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class _Update:
    """An input a call updates in place: see ``_Call.updates``."""

    result: int
    before_id: int
    after_id: int
    before: torch.Tensor


@dataclasses.dataclass(eq=False)
class _Call:
    """One embedded call: its computation, its inputs from outside (None where wired) and results (weakly).

    ``handles``: per outside input, its value key (see :func:`_pending_key`):
    inputs with one key in every micro-batch are passed to the loop once. ``leaves``: for a backward, per result, the leaf whose
    ``.grad`` the engine accumulates it into (None: none).
    """

    computation: Any
    inputs: list[Optional[torch.Tensor]]
    wires: tuple[_Wire, ...]
    handles: tuple[Optional[tuple[int, Any]], ...]
    results: list[WeakIdRef]
    backward: bool = False
    leaves: tuple[Optional[torch.Tensor], ...] = ()
    # Inputs the call updates in place (BatchNorm's statistics), by input index: the result that
    # becomes its new value, the id of the lazy tensor it held and of the one it takes, and its
    # value before the call (a tensor on the same data or IR).
    updates: dict[int, _Update] = dataclasses.field(default_factory=dict)

    def structure(self) -> tuple:
        return (id(self.computation), self.wires, tuple(id(leaf) if leaf is not None else None for leaf in self.leaves))


# Per leaf (by id): its ``.grad`` before a group's first micro-batch (None: the engine stored that
# micro-batch's gradient as it is).
_Starts = dict[int, Optional[torch.Tensor]]


class _Group:
    """Alike micro-batches in a row (each a list of calls with one ``structure``), and where they start."""

    def __init__(self, structure: tuple, starts: _Starts) -> None:
        self.structure = structure
        self.starts = starts
        self.micro_batches: list[list[_Call]] = []
        # Each leaf's .grad as the latest micro-batch left it.
        self.left: list[tuple[torch.Tensor, _Left]] = []
        # The latest loop's values for the forward results alive when it was built.
        self.result_values: list[tuple[WeakIdRef, torch.Tensor]] = []


class Accumulation:
    """The calls of one pending fused step, by micro-batch, and the folding of alike micro-batches."""

    def __init__(self) -> None:
        self.current: list[_Call] = []
        # This micro-batch's results by id: (the result, weakly; call index; result index).
        self._where: dict[int, tuple[WeakIdRef, int, int]] = {}
        self.group: Optional[_Group] = None
        self.closed: list[_Group] = []
        self._starts: Optional[_Starts] = None
        self._launches = counting.launches()
        self._queued_task: Optional[int] = None
        self.stopped = False
        # Stopped for a reason it warned about: counted when the optimizer step begins (what explain reads at the cut).
        self.unfolded = False

    # --- recording: the deferred graphs' on_embedded policies ---

    def record_forward(self, call: Embedded) -> None:
        if not self.stopped:
            self._record(call)

    def record_backward(self, call: Embedded) -> None:
        """Also: the leaf each result accumulates into, the ``.grad`` values a new group starts from,
        and the fold, queued for the end of the pass."""
        if self.stopped:
            return
        node = _private.current_autograd_node()
        task = _private.current_graph_task_id()
        if node is None or task < 0 or torch.is_grad_enabled():
            self.stop("a backward ran outside a plain backward pass (create_graph=True, or called directly)",
                      warn=False)
            return
        by_id = {id(r): m for m, r in enumerate(call.results)}
        leaves: list[Optional[torch.Tensor]] = [None] * len(call.results)
        for (fn, _), out in zip(node.next_functions, call.outs):
            if type(fn) is _private.AccumulateGrad and isinstance(out, torch.Tensor) and id(out) in by_id:
                try:
                    runs = _private.will_engine_execute_node(fn)
                except RuntimeError:  # torch refuses to say for a leaf under torch.autograd.grad
                    runs = False
                if not runs:
                    self.stop("a backward pass accumulates into only some leaves (torch.autograd.grad, "
                              "backward(inputs=...))", warn=False)
                    return
                leaves[by_id[id(out)]] = fn.variable
        first = not any(c.backward for c in self.current)
        self._record(call, tuple(leaves))
        if first:
            self._starts = {} if self._new_group() else None
        if self._starts is not None:
            for leaf in leaves:
                if leaf is not None and id(leaf) not in self._starts:
                    self._starts[id(leaf)] = _value_of(leaf.grad)
        if self._queued_task != task:
            self._queued_task = task
            _private.queue_engine_callback(self.end_of_backward)

    def _record(self, call: Embedded, leaves: Optional[tuple[Optional[torch.Tensor], ...]] = None) -> None:
        wires: list[_Wire] = []
        outside: list[Optional[torch.Tensor]] = []
        for t in call.inputs:
            found = self._where.get(id(t))
            if found is not None and found[0]() is t:
                wires.append(found[1:])
                outside.append(None)
            else:
                wires.append(None)
                outside.append(t)
        tensors = [t for t in outside if t is not None]
        pending = iter(_private.need_materialization(tensors) if tensors else [])
        is_pending = [t is None or next(pending) for t in outside]
        data = [t for t, p in zip(outside, is_pending) if not p]
        # Device data is keyed by its lazy tensor's id, not its buffer handle: a result of an execution still
        # in flight has no stable handle (see _private.buffer_handles), and reading it must not wait.
        handles = iter([(_DATA, _private.tensor_id(t)) for t in data])
        index = len(self.current)
        for m, r in enumerate(call.results):
            self._where[id(r)] = (WeakIdRef(r), index, m)
        # A pending input the call updates in place (BatchNorm's statistics) holds the micro-batches before it:
        # never walked (it is carried, or refused).
        written = {id(target) for target, _ in call.written}
        self.current.append(_Call(
            call.computation, outside, tuple(wires),
            tuple(None if t is None else next(handles) if not p else _pending_key(t, walk=id(t) not in written)
                  for t, p in zip(outside, is_pending)),
            [WeakIdRef(r) for r in call.results], leaves is not None, leaves or (), _updates(call, outside),
        ))

    def _new_group(self) -> bool:
        """At a micro-batch's first backward call: it cannot continue the current group (nothing to
        continue, an execution since, other calls, or a ``.grad`` that is not what the last micro-batch
        left: set to None or changed in place, e.g. by ``zero_grad()``)."""
        if self.group is None or counting.launches() != self._launches:
            log.debug("new group: %s", "the first" if self.group is None else "an execution since the last")
            return True
        prefix = tuple(c.structure() for c in self.current)
        if self.group.structure[:len(prefix)] != prefix:
            log.debug("new group: other calls than the group's micro-batches")
            return True
        if not all(left.holds(leaf.grad) for leaf, left in self.group.left):
            log.debug("new group: a .grad changed since the last micro-batch")
            return True
        return False

    def stop(self, reason: str, warn: bool = True) -> None:
        """Folds nothing more in this step (what is folded stays folded); warns once per reason, unless the
        reason is a pass that accumulates nothing into ``.grad`` as a loop of micro-batches would."""
        self.stopped = True
        self.current, self._where = [], {}
        if warn:
            self.unfolded = True
            _warn_once(reason)
        else:
            log.debug("not folding this step: %s", reason)

    # --- folding: an engine callback at the end of each backward pass ---

    def end_of_backward(self) -> None:
        self._queued_task = None
        micro_batch, self.current, self._where = self.current, [], {}
        starts, self._starts = self._starts, None
        if self.stopped or not micro_batch:
            return
        structure = tuple(c.structure() for c in micro_batch)
        if starts is not None or self.group is None or structure != self.group.structure:
            if self.group is not None:
                self.closed.append(self.group)
            # One that began like the group's micro-batches but went on differently stays unrolled; the
            # next starts a new group from the .grad values it leaves.
            self.group = _Group(structure, starts) if starts is not None else None
        if self.group is not None:
            self.group.micro_batches.append(micro_batch)
            if len(self.group.micro_batches) >= 2:
                refused = _fold(self.group)
                if refused is not None:
                    self.stop(*refused)
                    return
            leaves = {id(leaf): leaf for call in micro_batch for leaf in call.leaves if leaf is not None}
            # A .grad that took a value (a zero fill given back) holds it from now on, as an add would.
            _private.settle([leaf.grad for leaf in leaves.values() if leaf.grad is not None])
            self.group.left = [(leaf, _Left(leaf.grad)) for leaf in leaves.values()]
        self._launches = counting.launches()

    def finish(self) -> None:
        """Where the step's optimizer step begins: the forward results still alive take their values from
        the loops (so the step computes no micro-batch's forward again for them); recording stops."""
        taken = []
        for group in [*self.closed, *([self.group] if self.group else [])]:
            for ref, value in group.result_values:
                t = ref()
                if t is not None:
                    _private.take_value(t, value)
                    taken.append(t)
        if taken:
            _private.settle(taken)
        if self.unfolded:
            counting.bump(UNFOLDED_COUNTER)
        self.group, self.closed = None, []
        self.stopped = True
        self.current, self._where = [], {}


class _Left:
    """A ``.grad`` as a micro-batch left it: the id of the lazy tensor holding its value (an in-place change
    of ``.grad`` gives it a new one; a tensor given back as ``.grad`` that took the value keeps it)."""

    __slots__ = ("value",)

    def __init__(self, grad: Optional[torch.Tensor]) -> None:
        self.value = _private.tensor_id(grad) if grad is not None else None

    def holds(self, grad: Optional[torch.Tensor]) -> bool:
        return grad is not None and self.value == _private.tensor_id(grad)


# Kinds of value keys in _Call.handles: device data (its lazy tensor's id), constants (their graph hash), a
# lazy tensor (its id). Two inputs with one key hold one value.
_DATA, _CONSTANT, _LAZY = 0, 1, 2


def _pending_key(t: torch.Tensor, walk: bool) -> tuple[int, Any]:
    """The value key of a pending input: ``(_CONSTANT, graph hash)`` where its IR is made of constants only
    (a mask created per call: another tensor, the same value), else ``(_LAZY, its lazy tensor's id)`` (the
    same tensor, unchanged: a per-step value computed once, as Trainer's ``num_items_in_batch``). ``walk``:
    whether its IR may be walked (inputs from outside are small graphs; state updated in place is not)."""
    if walk and not _private.reads_device_data([t]):
        return _CONSTANT, _private.graph_hash([t])
    return _LAZY, _private.tensor_id(t)


def _updates(call: Embedded, outside: Sequence[Optional[torch.Tensor]]) -> dict[int, _Update]:
    """The inputs ``call`` updates in place, by input index (see ``_Call.updates``); those it cannot
    follow (an input passed twice, a new value that is no result) are left out, and then refused at the fold."""
    if not call.written:
        return {}
    results = {id(r): m for m, r in enumerate(call.results)}
    updates = {}
    for target, value in call.written:
        positions = [j for j, t in enumerate(outside) if t is target]
        if len(positions) == 1 and id(value) in results:
            updates[positions[0]] = _Update(
                results[id(value)], _private.tensor_id(target), _private.tensor_id(value), _value_of(target),
            )
    return updates


def _value_of(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` as it is now (a ``.grad``, state a call updates): a tensor on its current value, which later
    in-place updates of ``t`` leave alone (a new lazy tensor on the same data or IR: no op, no copy)."""
    if t is None:
        return None
    with torch.no_grad():
        return t.detach().clone()


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(
        f"{STEP_BACKEND_NAME}: gradient accumulation is not folded into one loop, so the step's program "
        f"holds every micro-batch (its compile time and memory grow with their number): {reason}"
    )


# --- the loop ----------------------------------------------------------------------


# How an input from outside reaches the loop: passed once (the same tensor and data in every micro-batch),
# stacked (sliced per iteration), or carried (updated in place by its call: the loop state).
_ONCE, _STACKED, _CARRIED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a loop computation is built from, tensors aside (its cache key)."""

    k: int
    computations: tuple[Any, ...]          # per call of a micro-batch
    wires: tuple[tuple[_Wire, ...], ...]   # per call, per input
    kinds: tuple[tuple[int, ...], ...]     # per call, per input from outside: _ONCE, _STACKED or _CARRIED
    carries: tuple[tuple[int, int, int], ...]  # per carried input: (call, input, the result that updates it)
    sums: tuple[tuple[tuple[int, int], ...], ...]  # per accumulated leaf: the (call, result)s it adds up
    stores_first: tuple[bool, ...]         # per accumulated leaf: .grad was None before the first
    results: tuple[tuple[int, int, bool], ...]  # per forward result given out: (call, result, stacked)


def _fold(group: _Group) -> Optional[tuple[str, bool]]:
    """Embeds the loop over ``group``'s micro-batches and re-points each ``.grad`` to its sum; or returns
    why it cannot, and whether to warn (then nothing changed: every check comes before any op)."""
    batches = group.micro_batches
    k = len(batches)
    first = batches[0]
    kinds: list[tuple[int, ...]] = []
    columns: list[list[torch.Tensor]] = []
    carries: list[tuple[int, int, int]] = []
    carried: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the input updated in place, its first value)
    for c, call in enumerate(first):
        flags = []
        for j, t in enumerate(call.inputs):
            if t is None:
                flags.append(_ONCE)
                continue
            column = [mb[c].inputs[j] for mb in batches]
            handles = [mb[c].handles[j] for mb in batches]
            if handles[0] is not None and all(h == handles[0] for h in handles):
                # One value in every micro-batch: the same data, or the same constants.
                flags.append(_ONCE)
                columns.append([t])
                continue
            if all(x is t for x in column):
                update = _carried(batches, c, j)
                if update is None:
                    return ("an input of a compiled graph changes between micro-batches in place, not as the "
                            "graph's own update of it"), True
                flags.append(_CARRIED)
                carries.append((c, j, update.result))
                carried.append((t, update.before))
                continue
            if call.backward and any(h is not None and h[0] == _DATA for h in handles):
                # Its forward executed on its own (it was said why): nothing of a loop to gain.
                return "a backward graph's saved activations were computed outside this backend's forward graphs", False
            if handles[-1][0] == _LAZY and _computed_from_calls(column[-1]):
                return (f"an input of a compiled {'backward' if call.backward else 'forward'} graph is computed "
                        f"outside the compiled graphs from a micro-batch's results (e.g. a loss computed eagerly "
                        f"from the compiled model's output: compile the loss with the model to fold)"), True
            flags.append(_STACKED)
            columns.append(column)
        kinds.append(tuple(flags))
    sums: dict[int, list[tuple[int, int]]] = {}
    leaves: dict[int, torch.Tensor] = {}
    for c, call in enumerate(first):
        for m, leaf in enumerate(call.leaves):
            if leaf is not None:
                sums.setdefault(id(leaf), []).append((c, m))
                leaves[id(leaf)] = leaf
            elif call.backward and call.results[m]() is not None and not _read_later(first, c, m):
                return "a backward graph's gradient flows into autograd nodes outside this backend's graphs", True
    if not sums:
        return "no gradient of the micro-batches accumulates into a leaf's .grad", False
    order = list(sums)
    starts = [group.starts.get(key) for key in order]
    # Forward results alive now, of any micro-batch of the group: given out by the loop.
    given: list[tuple[int, int, bool]] = []
    alive: list[list[tuple[int, torch.Tensor]]] = []
    for c, call in enumerate(first):
        if call.backward:
            continue
        for m in range(len(call.results)):
            live = [(i, t) for i, mb in enumerate(batches) for t in (mb[c].results[m](),) if t is not None]
            if live:
                given.append((c, m, any(i != k - 1 for i, _ in live)))
                alive.append(live)
    layout = _Layout(
        k, tuple(call.computation for call in first), tuple(call.wires for call in first), tuple(kinds),
        tuple(carries), tuple(tuple(sums[key]) for key in order), tuple(s is None for s in starts), tuple(given),
    )
    with torch.no_grad():
        inputs = [column[0] if len(column) == 1 else torch.stack(column) for column in columns]
        accs = [s if s is not None else torch.zeros_like(leaves[key]) for key, s in zip(order, starts)]
        buffers = []
        for (c, m, stacked_out), live in zip(given, alive):
            t = live[-1][1]
            buffers.append(torch.zeros((k, *t.shape) if stacked_out else t.shape, dtype=t.dtype, device=t.device))
        counter = torch.zeros((), dtype=torch.int32, device=leaves[order[0]].device)
        state = [counter, *inputs, *(before for _, before in carried), *accs, *buffers]
        outs = _private.user_computation(ACCUMULATION_LOOP_NAME, state, _loop(layout, state))
    n = 1 + len(inputs)
    # State the forward updates in place takes its value after the last micro-batch from the loop.
    for (target, _), value in zip(carried, outs[n:n + len(carried)]):
        _private.update_in_place(target, value)
    _private.settle([target for target, _ in carried])
    for (c, j, _), (target, _) in zip(carries, carried):
        update = batches[-1][c].updates[j]
        batches[-1][c].updates[j] = dataclasses.replace(update, after_id=_private.tensor_id(target))
    n += len(carried)
    for key, value in zip(order, outs[n:n + len(order)]):
        _private.update_in_place(leaves[key].grad, value)
    # Applied now: the engine's add then builds on the loop's value, and a later change of .grad shows.
    _private.settle([leaves[key].grad for key in order])
    grad_sync.keep_param_shardings([(leaves[key], leaves[key].grad) for key in order])
    group.result_values = [
        (WeakIdRef(t), buffer[i] if stacked_out else buffer)
        for (c, m, stacked_out), live, buffer in zip(given, alive, outs[n + len(order):])
        for i, t in live
    ]
    counting.bump(FOLD_COUNTER)
    log.debug("folded %d micro-batches: %d inputs (%d stacked), %d carried, %d gradients, %d results given out",
              k, len(inputs), sum(f == _STACKED for flags in kinds for f in flags), len(carried), len(order), len(given))
    return None


def _computed_from_calls(t: torch.Tensor) -> bool:
    """Whether ``t``'s pending IR holds an embedded graph or loop: stacked, it would carry that
    micro-batch's computation into the step beside the loop. Only the newest micro-batch's input is
    looked at, once (its IR: a small graph of eager ops at most, an embedded call being one node)."""
    text = _private.ir_text([t])
    return USER_COMPUTATION_NAME in text or ACCUMULATION_LOOP_NAME in text


def _carried(batches: Sequence[list[_Call]], c: int, j: int) -> Optional[_Update]:
    """The first micro-batch's update of input ``j`` of call ``c``, if every micro-batch's call updates it
    in place into the same result and each takes exactly the value the one before wrote (the loop then
    carries it); None otherwise."""
    updates = [mb[c].updates.get(j) for mb in batches]
    if any(u is None or u.result != updates[0].result for u in updates):
        return None
    if any(u.before_id != prev.after_id for prev, u in zip(updates, updates[1:])):
        return None
    return updates[0]


def _read_later(calls: Sequence[_Call], c: int, m: int) -> bool:
    """Whether a call after ``calls[c]`` takes its result ``m`` as an input."""
    return any(w == (c, m) for call in calls[c + 1:] for w in call.wires)


# Built loop computations by layout, oldest dropped first (a step with K micro-batches builds K - 1).
_loops: dict[_Layout, Any] = {}
_LOOP_CACHE_SIZE = 256


def _loop(layout: _Layout, state: Sequence[torch.Tensor]) -> Any:
    """The loop computation for ``layout`` (``state``: its initial values, for their shapes)."""
    loop = _loops.pop(layout, None)
    if loop is None:
        loop = _build(layout, state)
        if len(_loops) >= _LOOP_CACHE_SIZE:
            _loops.pop(next(iter(_loops)))
    _loops[layout] = loop
    return loop


def _build(layout: _Layout, state: Sequence[torch.Tensor]) -> Any:
    """The While computation over state ``(i, *inputs, *carried, *sums, *results)``, ``layout.k`` iterations.

    Per iteration: each call of a micro-batch, in order, on the inputs passed
    once, the ``i``-th slice of the stacked ones, and its micro-batch's
    earlier results where wired, the carried state where updated in place
    (then the call's new value of it is carried on); each sum adds its gradients (the first
    iteration stores them as they are where ``.grad`` was None, as the engine
    does); each given-out result is written to its slot (or kept, the last).
    """
    xb = _private.xla_builder
    builder = xb.create_builder("accumulation")
    params = [xb.mkparam(builder, n, xb.tensor_shape(t)) for n, t in enumerate(state)]
    n_inputs = sum(kind != _CARRIED and w is None for wires, kinds in zip(layout.wires, layout.kinds)
                   for w, kind in zip(wires, kinds))
    n_carries, n_sums = len(layout.carries), len(layout.sums)

    def body(i: Any, *rest: Any) -> tuple:
        inputs, rest = rest[:n_inputs], rest[n_inputs:]
        carries, rest = list(rest[:n_carries]), rest[n_carries:]
        sums, buffers = rest[:n_sums], rest[n_sums:]
        slot = {(c, j): n for n, (c, j, _) in enumerate(layout.carries)}
        zero = i.zeros_like()
        given = iter(inputs)
        calls = []
        for c, computation in enumerate(layout.computations):
            args = []
            for j, wire in enumerate(layout.wires[c]):
                if wire is not None:
                    args.append(calls[wire[0]].get_tuple_element(wire[1]))
                    continue
                if layout.kinds[c][j] == _CARRIED:
                    args.append(carries[slot[(c, j)]])
                    continue
                x = next(given)
                if layout.kinds[c][j] == _STACKED:
                    sizes = list(x.shape().sizes)
                    x = x.dynamic_slice([i] + [zero] * (len(sizes) - 1), [1] + sizes[1:]).reshape(sizes[1:])
                args.append(x)
            calls.append(xb.Op.call(computation, args))
            for n, (cc, _, m) in enumerate(layout.carries):
                if cc == c:
                    carries[n] = calls[c].get_tuple_element(m)
        new_sums = []
        for total, parts, store in zip(sums, layout.sums, layout.stores_first):
            g = calls[parts[0][0]].get_tuple_element(parts[0][1])
            for c, m in parts[1:]:
                g = g + calls[c].get_tuple_element(m)
            added = total + g
            if store:
                first = (i == zero).broadcast(list(total.shape().sizes))
                added = first.select(g, added)
            new_sums.append(added)
        new_buffers = []
        for buffer, (c, m, stacked) in zip(buffers, layout.results):
            value = calls[c].get_tuple_element(m)
            if stacked:
                sizes = list(value.shape().sizes)
                value = buffer.dynamic_update_slice(value.reshape([1] + sizes), [i] + [zero] * len(sizes))
            new_buffers.append(value)
        one = xb.Op.scalar(i.builder(), 1, dtype=xb.Type.S32)
        return (i + one, *inputs, *carries, *new_sums, *new_buffers)

    def cond(i: Any, *rest: Any) -> Any:
        return i < xb.Op.scalar(i.builder(), layout.k, dtype=xb.Type.S32)

    return xb.Op.mkwhile(params, cond, body).build("accumulation_loop")
