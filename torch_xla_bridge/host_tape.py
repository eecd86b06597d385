"""A replayed step's inputs computed on the host: an optimizer's tensor hyperparameters.

PyTorch's idiom for a learning rate that changes without recompiling is a
0-dim CPU tensor (``lr=torch.tensor(0.01)``), which a scheduler fills in place
(``LRScheduler`` calls ``fill_`` on a tensor ``lr``). An optimizer that reads
it as a tensor (Adam and AdamW with ``capturable=True``) computes host values
from it (``1 - lr * weight_decay``) and uses them in device ops, where
torch_xla transfers each as device data: new data for the same program.

While a capture traces an optimizer's step, a :class:`Tape` (a dispatch mode,
entered around an eager ``optimizer.step`` only, by torch's step hooks: a mode
active around the compiled forward would change dynamo's guards and recompile it) records the host ops
computed from those tensors and makes each transfer itself, the device data
torch_xla would make. A replay reruns the recorded host ops on the tensors'
current values (:class:`HostInputs`) and transfers the results, one vector per
dtype; nothing is recomputed while the tensors' versions stand still.

Invariant: a hyperparameter is an input only if nothing the tape saw read a
value derived from it as a Python number (SGD's ``alpha=-lr`` calls
``.item()``: the number is in the trace) or wrote one in place; otherwise a
change to it retraces (the replay's guards keep its version).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.utils._pytree as pytree
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import _private


def hyperparameter_tensors(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The 0-dim CPU tensors among the optimizers' hyperparameters (a tensor ``lr``): the tape's roots."""
    seen: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for key, v in group.items():
                if key != "params" and isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.dim() == 0:
                    seen[id(v)] = v
    return list(seen.values())


@dataclasses.dataclass(frozen=True)
class _Ref:
    """An argument of a recorded op that is the value of another node."""

    node: int


@dataclasses.dataclass(frozen=True)
class _Node:
    """A host op on tape values: ``func(*args, **kwargs)`` rebuilt from ``leaves`` (a :class:`_Ref` for a tape
    value) and ``spec``; ``index`` picks one output of an op that returns several."""

    func: Any
    leaves: tuple
    spec: pytree.TreeSpec
    index: Optional[int]


class Tape(_private.TorchDispatchMode):
    """Records the host math on ``roots`` during an optimizer's step (see the module).

    Node ``k < len(roots)`` is root ``k``; every later node is a :class:`_Node`
    over earlier ones. Equal ops on equal arguments share a node (a per-
    parameter ``1 - lr * weight_decay`` is one value, recomputed once).
    """

    def __init__(self, roots: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.roots = list(roots)
        self.nodes: list[Optional[_Node]] = [None] * len(self.roots)
        self.roots_of: list[frozenset[int]] = [frozenset([k]) for k in range(len(self.roots))]
        # Every tape value seen, kept alive while recording so that an id is never reused.
        self._held: list[torch.Tensor] = list(self.roots)
        self._node_of: dict[int, int] = {id(t): k for k, t in enumerate(self.roots)}
        self._value: dict[int, torch.Tensor] = dict(enumerate(self.roots))  # each node's first value
        self._by_key: dict[tuple, int] = {}
        # (device value, node): the transfers made in place of torch_xla's.
        self.uploads: list[tuple[torch.Tensor, int]] = []
        self._upload_of: dict[tuple[int, str], torch.Tensor] = {}
        # Roots whose values (or values derived from them) the step read as numbers or wrote in place.
        self.escaped: set[int] = set()

    @classmethod
    def is_infra_mode(cls) -> bool:
        return True  # dynamo runs a compiled region (never under it: see the module) as it would without it

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        leaves, spec = pytree.tree_flatten((args, kwargs))
        hits = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor) and id(a) in self._node_of]
        if not hits:
            return func(*args, **kwargs)
        nodes = [self._node_of[id(leaves[i])] for i in hits]
        roots = frozenset().union(*(self.roots_of[n] for n in nodes))
        device = next((a.device for a in leaves if isinstance(a, torch.Tensor) and a.device.type != "cpu"), None)
        if device is not None:
            # A device op reading host values: they go in as device data made here, recorded.
            if any(leaves[i].dim() != 0 for i in hits):
                self.escaped |= roots
                return func(*args, **kwargs)
            for i, n in zip(hits, nodes):
                leaves[i] = self._upload(n, device)
            args, kwargs = pytree.tree_unflatten(leaves, spec)
            return func(*args, **kwargs)
        versions = [leaves[i]._version for i in hits]
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if (any(leaves[i]._version != v for i, v in zip(hits, versions))
                or not all(isinstance(o, torch.Tensor) and o.device.type == "cpu" for o in outs)):
            # Read as a number (.item()), written in place, or moved by hand: not recomputable as an input.
            self.escaped |= roots
            return out
        template = list(leaves)
        for i, n in zip(hits, nodes):
            template[i] = _Ref(n)
        for index, o in enumerate(outs):
            node = _Node(func, tuple(template), spec, index if isinstance(out, (tuple, list)) else None)
            key = _key(node)
            k = self._by_key.get(key) if key is not None else None
            if k is None:
                k = len(self.nodes)
                self.nodes.append(node)
                self.roots_of.append(roots)
                if key is not None:
                    self._by_key[key] = k
            self._node_of[id(o)] = k
            self._value.setdefault(k, o)
            self._held.append(o)
        return out

    def _upload(self, node: int, device: torch.device) -> torch.Tensor:
        value = self._upload_of.get((node, str(device)))
        if value is None:
            value = self._value[node].to(device)
            self._upload_of[(node, str(device))] = value
            self.uploads.append((value, node))
        return value

    def note_transfer(self, value: torch.Tensor, sources: Sequence[torch.Tensor]) -> None:
        """A transfer made outside the mode (a compiled optimizer step stacks its host scalars, see
        replay._compiled_transfers_noted): a program input if every source is a tape value, else left unknown."""
        nodes = [self._node_of.get(id(t)) for t in sources]
        if any(n is None for n in nodes):
            return
        leaves, spec = pytree.tree_flatten((([_Ref(n) for n in nodes],), {}))
        node = len(self.nodes)
        self.nodes.append(_Node(torch.ops.aten.stack.default, tuple(leaves), spec, None))
        self.roots_of.append(frozenset().union(*(self.roots_of[n] for n in nodes)))
        self._value[node] = torch.stack([self._value[n] for n in nodes])
        self.uploads.append((value, node))

    def inputs(self, constants: Sequence[torch.Tensor] = ()) -> Optional["HostInputs"]:
        """The transfers a replay redoes (those of roots that did not escape), or None if there are none.

        ``constants``: the program's other 0-dim inputs (device data the trace made of Python numbers). One
        equal to a tape value may be that value read outside the tape (by code of the step outside
        ``optimizer.step``): its roots then keep their guards, as if they had escaped.
        """
        numbers = {(c.dtype, c.item()) for c in constants if c.dtype.is_floating_point}
        for k, value in self._value.items():
            if value.dim() == 0 and any(value.to(dtype).item() == number for dtype, number in numbers):
                self.escaped |= self.roots_of[k]
        kept = [(value, node) for value, node in self.uploads if not (self.roots_of[node] & self.escaped)]
        if not kept:
            return None
        needed: set[int] = set()
        stack = [node for _, node in kept]
        while stack:
            k = stack.pop()
            if k in needed:
                continue
            needed.add(k)
            node = self.nodes[k]
            if node is not None:
                stack.extend(a.node for a in node.leaves if isinstance(a, _Ref))
        # 0-dim transfers of one dtype go as one vector; another (a compiled step's packed scalars) as it is.
        vectors: list[tuple[list[int], torch.dtype, str, Optional[list[int]]]] = []
        by_dtype: dict[tuple[torch.dtype, str], int] = {}
        layout: list[tuple[int, Optional[int]]] = []
        for value, node in kept:
            if value.dim() != 0:
                layout.append((len(vectors), None))
                vectors.append(([node], value.dtype, str(value.device), list(value.shape)))
                continue
            v = by_dtype.setdefault((value.dtype, str(value.device)), len(vectors))
            if v == len(vectors):
                vectors.append(([], value.dtype, str(value.device), None))
            layout.append((v, len(vectors[v][0])))
            vectors[v][0].append(node)
        return HostInputs(
            roots=[weakref.ref(t) for t in self.roots],
            nodes=[(k, self.nodes[k]) for k in sorted(needed) if self.nodes[k] is not None],
            vectors=vectors, uploads=[value for value, _ in kept], layout=layout,
            # Only roots that feed a kept transfer: one the tape never saw read gains nothing from dropping its guard.
            relaxed=frozenset(id(self.roots[k]) for _, node in kept for k in self.roots_of[node]),
        )


def _key(node: _Node) -> Optional[tuple]:
    """A hashable identity of an op and its arguments (tensors by identity), or None if an argument is not."""
    parts = []
    for a in node.leaves:
        if isinstance(a, torch.Tensor):
            parts.append(("tensor", id(a)))
        else:
            try:
                hash(a)
            except TypeError:
                return None
            parts.append((type(a), a))
    return (node.func, str(node.spec), node.index, tuple(parts))


@dataclasses.dataclass
class HostInputs:
    """The host values a replay transfers: recomputed from the roots' current values when one changed.

    ``vectors[v]`` is ``(nodes, dtype, device, shape)``: 0-dim nodes transferred together as one vector (shape
    None), or one node transferred as it is (its shape). ``uploads[k]`` is the device value the capture read for
    transfer ``k`` and ``layout[k]`` its ``(vector, position)`` (position None: the whole vector).
    ``relaxed``: the ids of the roots that are inputs (their versions need no guard). ``packed``: False for a
    program that reads each transfer as it was made (one 0-dim value each: the SPMD replay, which runs the
    traced program itself).
    """

    roots: list[weakref.ref[torch.Tensor]]
    nodes: list[tuple[int, _Node]]
    vectors: list[tuple[list[int], torch.dtype, str, Optional[list[int]]]]
    uploads: list[torch.Tensor]
    layout: list[tuple[int, Optional[int]]]
    relaxed: frozenset[int]
    packed: bool = True
    _versions: Optional[tuple] = None
    _values: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def values(self) -> list[torch.Tensor]:
        """One device vector per entry of ``vectors`` (or, not ``packed``, one value per transfer), from the roots'
        values now (the guards hold them alive)."""
        roots = [r() for r in self.roots]
        versions = tuple(t._version for t in roots)
        if versions != self._versions:
            values: dict[int, Any] = dict(enumerate(roots))
            with torch.no_grad():
                for k, node in self.nodes:
                    leaves = [values[a.node] if isinstance(a, _Ref) else a for a in node.leaves]
                    args, kwargs = pytree.tree_unflatten(leaves, node.spec)
                    out = node.func(*args, **kwargs)
                    values[k] = out if node.index is None else out[node.index]
                if self.packed:
                    self._values = [(torch.stack([values[k] for k in nodes]) if shape is None else
                                     values[nodes[0]]).to(device) for nodes, _, device, shape in self.vectors]
                else:
                    self._values = [values[self.vectors[v][0][j or 0]].to(self.vectors[v][2]) for v, j in self.layout]
            self._versions = versions
        return self._values

    def forget(self) -> None:
        """Drops what the capture held (its device values), once its program is built."""
        self.uploads = []


@contextlib.contextmanager
def recording(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[Optional[Tape]]:
    """While tracing a capture: a :class:`Tape` entered around each eager ``step`` of the optimizers that hold
    tensor hyperparameters (torch's global optimizer step hooks, registered for the duration: they see a step
    however it is called, ``opt.step()`` or a bound method kept before), or None if none hold any."""
    roots = hyperparameter_tensors(optimizers)
    if not roots:
        yield None
        return
    tape = Tape(roots)
    owners = {id(o) for o in optimizers if hyperparameter_tensors([o])}
    entered: list[bool] = []

    def enter(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in owners and not torch.compiler.is_compiling():
            tape.__enter__()
            entered.append(True)

    def leave(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if id(optimizer) in owners and entered:
            entered.pop()
            tape.__exit__(None, None, None)

    handles = [register_optimizer_step_pre_hook(enter),
               register_optimizer_step_post_hook(leave)]
    try:
        yield tape
    finally:
        for handle in handles:
            handle.remove()
        while entered:  # a step that raised never reached its post hook
            entered.pop()
            tape.__exit__(None, None, None)

