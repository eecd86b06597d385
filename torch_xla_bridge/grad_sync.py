"""The engine callback and the one sync that ends a backward pass.

A deferred backward graph (:mod:`torch_xla_bridge.deferred`) returns pending
XLA tensors; the autograd engine then accumulates them into ``.grad``
lazily. :func:`sync_at_end_of_backward` queues one callback per backward pass,
which the engine runs after its last AccumulateGrad node. That callback
materializes, in exactly one ``_xla_sync_multi`` call, the ``.grad`` of every
leaf the compiled graphs feed and every still-alive output of the deferred
graphs, so backward and accumulation are one XLA execution.

The leaves are read off the autograd graph itself: the AccumulateGrad nodes
among the ``next_functions`` of the compiled graph's backward node, i.e.
exactly the parameters and ``requires_grad`` inputs that this call's forward
consumed, with no registry to go stale.

Per-pass state lives in :class:`_BackwardPass`, which is strongly referenced
only by the callback the engine holds: it dies with the engine's graph task,
whether the pass completes or raises, so a failed backward leaves nothing behind.

Under SPMD each ``.grad`` is pinned to its parameter's sharding before the
sync (:func:`keep_param_shardings`).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch_xla.runtime as xr

from . import _private
from .names import SYNC_COUNTER

# Runs a sync (the callable) of the tensors given, watching it: see sync_at_end_of_backward.
Guard = Callable[[Callable[[], None], list[torch.Tensor]], None]

log = logging.getLogger(__name__)


class _BackwardPass:
    """What one backward pass deferred: nodes whose leaves' ``.grad`` to sync, outputs not to recompute."""

    __slots__ = ("nodes", "outputs", "guard", "__weakref__")

    def __init__(self) -> None:
        self.nodes: list[torch.autograd.graph.Node] = []
        self.outputs: list[weakref.ref[torch.Tensor]] = []
        self.guard: Optional[Guard] = None

    def add(self, node: Optional[torch.autograd.graph.Node], outputs: Sequence[torch.Tensor]) -> None:
        if node is not None:
            self.nodes.append(node)
        self.outputs.extend(map(weakref.ref, outputs))

    def tensors_to_sync(self) -> list[torch.Tensor]:
        # Every leaf of a graph compiled by this backend is on XLA (checked at
        # compile time), so no device test; two graphs may share a leaf, and an
        # output may be a .grad itself, hence the deduplication.
        tensors: dict[int, torch.Tensor] = {}
        leaves: list[tuple[torch.Tensor, torch.Tensor]] = []
        for node in self.nodes:
            for fn, _ in node.next_functions:
                if type(fn) is _private.AccumulateGrad:
                    grad = fn.variable.grad
                    if grad is not None:
                        leaves.append((fn.variable, grad))
                        tensors[id(grad)] = grad
        keep_param_shardings(leaves)
        for ref in self.outputs:
            t = ref()
            if t is not None:
                tensors[id(t)] = t
        return list(tensors.values())

    def end_of_backward(self) -> None:
        """The engine callback: exactly one sync per backward pass."""
        tensors = self.tensors_to_sync()
        self.nodes.clear()
        self.outputs.clear()
        _private.increment_counter(SYNC_COUNTER, 1)
        # Asynchronous: the host goes on tracing (the optimizer, the next step)
        # while the device runs backward + accumulation; readers wait as usual.
        if self.guard is None:
            sync(tensors)
        else:
            self.guard(lambda: sync(tensors), tensors)


def sync(tensors: Sequence[torch.Tensor], *, wait: bool = False, fresh: bool = False) -> None:
    """Materializes ``tensors`` in one execution, donating none of their old buffers.

    ``fresh=True``: the tensors are a graph's new outputs, and the inputs it
    wrote into (BatchNorm's statistics); the sync then donates like an
    execution of upstream's bridge: the written inputs' old buffers, and those
    a user marked with ``dynamo_set_buffer_donor_``. So no other pending IR may
    still read those buffers (a step left pending, whose gradients read the
    statistics: such a caller syncs the whole step instead).

    The one place the package syncs a set of tensors. With
    ``sync_xla_data=True`` torch_xla would donate each synced tensor's current
    buffer to its new value (buffer aliasing), which is only safe at a step
    barrier, where every live tensor is synced: here other pending IR may
    still read an old ``.grad`` (an eager optimizer's lazy update, a logged
    ``p.grad.norm()``, ``clip_grad_norm_``'s total), and its execution would
    find the buffer deleted. ``sync_xla_data=False`` still replaces each
    tensor's IR by device data; the old buffer is freed with its last reader.
    """
    if tensors:
        _private.XLAC._xla_sync_multi(list(tensors), devices=[], wait=wait, sync_xla_data=fresh)


def sync_fresh(outputs: Sequence[torch.Tensor]) -> None:
    """``on_pending`` of a graph that executes at once: its new outputs in one execution (see :func:`sync`)."""
    sync(outputs, fresh=True)


def keep_param_shardings(leaves: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Makes each pending ``grad`` come out of its execution sharded like its ``param``.

    ``leaves`` holds ``(param, grad)`` pairs. Nothing in the backward pins the
    sharding of a gradient, so without this the partitioner picks one (e.g. a
    ``[4,1]``-sharded weight got a ``[1,4]`` gradient, a sharded bias a
    replicated one); annotated here, before the sync, the partitioner produces
    it in its parameter's layout inside the same execution. A no-op without
    SPMD (checked once per call: this runs on every backward), for an
    unsharded parameter, and where the shardings already agree (every step
    after the first, for an accumulated ``.grad``).
    """
    if not leaves or not xr.is_spmd():
        return
    for param, grad in leaves:
        spec = _private.sharding_spec(param)
        if spec and spec != _private.sharding_spec(grad):
            _private.mark_sharding(grad, _private.op_sharding(param))


# Keyed by the engine's graph-task id; values die with the task (see module docstring).
_passes: weakref.WeakValueDictionary[int, _BackwardPass] = weakref.WeakValueDictionary()


def sync_at_end_of_backward(outputs: Sequence[torch.Tensor], guard: Optional[Guard] = None) -> None:
    """Defers materializing ``outputs`` and the current node's leaves' ``.grad`` to the end of the pass.

    Called from a deferred backward graph while the engine runs its node.
    Outside an autograd engine pass (nothing to wait for) the outputs are
    synced at once. ``guard``: runs the pass's sync (the callable it is given)
    and may watch it, given the tensors it syncs (whether XLA refuses it).
    """
    task_id = _private.current_graph_task_id()
    if task_id < 0:
        sync(outputs)
        return
    state = _passes.get(task_id)
    if state is None:
        state = _BackwardPass()
        _passes[task_id] = state
        _private.queue_engine_callback(state.end_of_backward)
    state.add(_private.current_autograd_node(), outputs)
    if guard is not None:
        state.guard = guard


def store_like_a_first_gradient(grads: Sequence[Any]) -> None:
    """Makes the engine store each gradient into a zero-filled ``.grad`` as it stores a first one.

    Called by a deferred backward node while the engine runs it, before the
    AccumulateGrad nodes it feeds: ``grads[i]`` goes to ``next_functions[i]``
    (AOTAutograd's trailing token / RNG outputs have no edge). Why: the engine
    stores a leaf's first gradient as it is (``.grad = g``) but adds later ones
    to the zero fill ``zero_grad(set_to_none=False)`` leaves (``0 + g``), two
    different graphs, so a fused backward compiled at the first and again at
    the second step. A ``.grad`` whose pending IR is exactly that zero fill is
    set aside (``.grad = None``) so the engine stores ``g``; at the end of the
    pass the held tensor takes ``g``'s lazy tensor (no op in the graph) and is
    ``.grad`` again, so a user holding it sees it updated, as after an add.
    Values are unchanged (``0 + g == g``). Loops with ``set_to_none=True`` pay
    one ``is None`` per leaf; leaves whose AccumulateGrad does not run
    (``torch.autograd.grad``, ``backward(inputs=...)``) and passes with
    ``create_graph=True`` are left alone.
    """
    if torch.is_grad_enabled():
        return
    node = _private.current_autograd_node()
    if node is None:
        return
    edges = node.next_functions
    if len(grads) < len(edges):
        return
    filled = [
        fn for (fn, _), grad in zip(edges, grads)
        if type(fn) is _private.AccumulateGrad and isinstance(grad, torch.Tensor) and fn.variable.grad is not None
    ]
    if not filled:
        return
    pending = _private.need_materialization([fn.variable.grad for fn in filled])
    filled = [fn for fn, is_pending in zip(filled, pending) if is_pending]
    held = [fn.variable.grad for fn in filled]
    set_aside: list[tuple[torch.Tensor, torch.Tensor]] = []
    for fn, grad, zero_fill in zip(filled, held, zero_fills(held)):
        if not zero_fill:
            continue
        try:
            runs = _private.will_engine_execute_node(fn)
        except RuntimeError:  # torch refuses to say for a leaf under torch.autograd.grad, which accumulates nothing
            return
        if runs:
            fn.variable.grad = None
            set_aside.append((fn.variable, grad))
    if set_aside:
        _private.queue_engine_callback(lambda: _give_back(set_aside))


def _give_back(set_aside: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Engine callback: each held ``.grad`` takes the gradient the engine stored, and is ``.grad`` again.

    Queued before the end-of-backward sync's callback of the same pass (if
    any), which then materializes the held tensor. A ``.grad`` a hook cleared
    stays None.
    """
    with torch.no_grad():
        for leaf, held in set_aside:
            stored = leaf.grad
            if stored is not None and stored is not held:
                # The stored gradient's lazy tensor, IR and id both: the step's graph (its
                # outputs ordered by tensor id) stays the first step's.
                _private.take_value(held, stored)
                leaf.grad = held


def zero_fills(grads: list[torch.Tensor]) -> list[bool]:
    """Which of the pending ``grads`` hold exactly the zero fill ``zero_()`` leaves (constants only, same graph).

    All at once first: the hash of their joint IR against fresh zeros' of the
    same shapes (a cache by shapes), as after ``zero_grad`` every one is; only
    then are the device-data leaves looked for, in those small graphs (the
    lookup creates a tensor per leaf). Else one by one, each root compared
    first: a gradient a micro-batch left pending has another root, and a
    walk of its IR (the whole micro-batch) per leaf would cost milliseconds.
    """
    if not grads:
        return []
    if len({g.device for g in grads}) == 1:
        shapes = tuple((tuple(g.shape), g.dtype) for g in grads)
        if (_private.graph_hash(grads) == _zero_fills_hash(shapes, str(grads[0].device))
                and not _private.reads_device_data(grads)):
            return [True] * len(grads)
    return [_is_zero_fill(g) for g in grads]


@functools.lru_cache(maxsize=16)
def _zero_fills_hash(shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...], device: str) -> bytes:
    """The joint graph hash of ``zero_()`` on tensors of these shapes and dtypes (a cache by that key)."""
    return _private.graph_hash([torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in shapes])


def _is_zero_fill(grad: torch.Tensor) -> bool:
    """``grad``'s pending IR is the zero fill ``zero_()`` leaves; its IR root is compared first (see zero_fills)."""
    shape, dtype, device = tuple(grad.shape), grad.dtype, str(grad.device)
    root, graph = _zero_fill(shape, dtype, device)
    if _private.ir_root(grad) != root or _private.reads_device_data([grad]):
        return False
    return _private.graph_hash([grad]) == graph


@functools.lru_cache(maxsize=None)
def _zero_fill(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> tuple[Optional[str], bytes]:
    """The IR root and graph hash of ``zero_()`` on a tensor of this shape, dtype and device (a cache by that key)."""
    zeros = torch.zeros(shape, dtype=dtype, device=device)
    return _private.ir_root(zeros), _private.graph_hash([zeros])


def live_backward_passes() -> int:
    """Number of backward passes whose per-pass state is alive (0 between steps)."""
    return len(_passes)
