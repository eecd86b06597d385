"""The engine callback and the one sync that ends a backward pass.

A deferred backward graph (:mod:`torch_xla_bridge.dynamo_bridge`) returns
pending XLA tensors; the autograd engine then accumulates them into ``.grad``
lazily. :func:`sync_at_end_of_backward` queues one callback per backward pass,
which the engine runs after its last AccumulateGrad node. That callback
materializes, in exactly one ``_xla_sync_multi`` call, every pending ``.grad``
of the leaves the compiled graphs saw and every still-alive output of the
deferred graphs, so backward and accumulation are one XLA execution.

Per-pass state lives in :class:`_BackwardPass`, which is strongly referenced
only by the callback the engine holds: it dies with the engine's graph task,
whether the pass completes or raises, so a failed backward leaves nothing behind.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Iterator, Sequence

import torch
import torch_xla

log = logging.getLogger(__name__)

# A torch_xla counter (shown by metrics_report()) bumped by every end-of-backward sync.
SYNC_COUNTER = "OpenxlaFusedGradSync"


class LeafRegistry:
    """The autograd leaves (parameters, inputs with ``requires_grad``) one compiled graph saw.

    Positions of leaves among the graph's runtime arguments are fixed when the
    graph is compiled (dynamo guards on ``requires_grad``); the tensors are held
    weakly, keyed by ``id`` and checked for identity on read, so a dead tensor is
    never mistaken for a newer one that reuses its id.
    """

    def __init__(self, positions: Sequence[int], static_leaves: Sequence[torch.Tensor]) -> None:
        self._positions = tuple(positions)
        self._tensors: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        for t in static_leaves:
            self._tensors[id(t)] = t

    @classmethod
    def for_graph(cls, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> "LeafRegistry":
        positions = [
            i
            for i, t in enumerate(example_inputs)
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf
        ]
        # Parameters that dynamo kept on the module (not lifted to inputs).
        static = [p for p in gm.parameters() if p.requires_grad]
        return cls(positions, static)

    def record(self, args: Sequence[Any]) -> None:
        tensors = self._tensors
        for i in self._positions:
            t = args[i]
            if tensors.get(id(t)) is not t:
                tensors[id(t)] = t

    def grads(self) -> Iterator[torch.Tensor]:
        for t in list(self._tensors.values()):
            g = t.grad
            if g is not None and g.device.type == "xla":
                yield g

    def __len__(self) -> int:
        return len(self._tensors)


class _BackwardPass:
    """What one backward pass deferred: leaves whose ``.grad`` to sync, outputs to keep from recomputing."""

    __slots__ = ("leaf_registries", "outputs", "task_id", "__weakref__")

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self.leaf_registries: dict[int, LeafRegistry] = {}
        self.outputs: list[weakref.ref[torch.Tensor]] = []

    def add(self, leaves: LeafRegistry, outputs: Sequence[torch.Tensor]) -> None:
        self.leaf_registries[id(leaves)] = leaves
        self.outputs.extend(weakref.ref(t) for t in outputs)

    def tensors_to_sync(self) -> list[torch.Tensor]:
        tensors = [g for leaves in self.leaf_registries.values() for g in leaves.grads()]
        tensors.extend(t for t in (r() for r in self.outputs) if t is not None)
        return tensors

    def sync(self) -> None:
        """The engine callback: exactly one sync per backward pass."""
        tensors = self.tensors_to_sync()
        self.outputs.clear()
        self.leaf_registries.clear()
        torch_xla._XLAC._xla_increment_counter(SYNC_COUNTER, 1)
        _sync(tensors)


def _sync(tensors: list[torch.Tensor]) -> None:
    if tensors:
        torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=False, sync_xla_data=True)


# Keyed by the engine's graph-task id; values die with the task (see module docstring).
_passes: weakref.WeakValueDictionary[int, _BackwardPass] = weakref.WeakValueDictionary()


def sync_at_end_of_backward(leaves: LeafRegistry, outputs: Sequence[torch.Tensor]) -> None:
    """Defers materializing ``outputs`` and ``leaves``' ``.grad`` to the end of the current backward pass.

    Called from a deferred backward graph. Outside an autograd engine pass
    (nothing to wait for) the tensors are synced at once.
    """
    task_id = torch._C._current_graph_task_id()
    if task_id < 0:
        _sync(list(outputs))
        return
    state = _passes.get(task_id)
    if state is None:
        state = _BackwardPass(task_id)
        _passes[task_id] = state
        torch.autograd.Variable._execution_engine.queue_callback(state.sync)
    state.add(leaves, outputs)


def live_backward_passes() -> int:
    """Number of backward passes whose per-pass state is alive (0 between steps)."""
    return len(_passes)
