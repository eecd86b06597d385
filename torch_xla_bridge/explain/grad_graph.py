"""The autograd graph of a loss: every AccumulateGrad node and who feeds each ``.grad``.

:func:`autograd_graph` walks ``loss.grad_fn`` and its ``next_functions`` (the
graph the engine will run) without running anything. For each leaf it lists the
*contributors*: the distinct backward nodes with an edge into its AccumulateGrad
node. The engine sums their gradients into ``.grad``, so a parameter used twice
in a model run eagerly (tied weights) has two contributors; inside one compiled
graph the sum happens in the graph and its ``CompiledFunctionBackward`` is the
single contributor.

Output as text (:meth:`GradGraph.text`), Graphviz DOT (:meth:`GradGraph.dot`)
and PNG (:meth:`GradGraph.render`, which needs Graphviz's ``dot``: on Debian
``apt-get install graphviz``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import shutil
import subprocess
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from .. import _private

log = logging.getLogger(__name__)

_AccumulateGrad = torch._C._functions.AccumulateGrad
Names = Union[nn.Module, Mapping[str, torch.Tensor], None]


@dataclasses.dataclass
class Leaf:
    """One AccumulateGrad node: the leaf it accumulates into and its contributors."""

    node: int  # index into GradGraph.nodes
    name: str
    shape: tuple[int, ...]
    contributors: list[tuple[int, int]]  # (node index, number of edges from it)

    def to_dict(self, graph: "GradGraph") -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "contributors": [{"node": graph.nodes[i], "edges": k} for i, k in self.contributors],
        }


@dataclasses.dataclass
class GradGraph:
    """Nodes (by name, in breadth-first order from the roots), edges, and leaves."""

    nodes: list[str]
    edges: list[tuple[int, int]]  # (node, next node): gradient flows from node to next
    leaves: list[Leaf]

    def leaf(self, name: str) -> Leaf:
        for leaf in self.leaves:
            if leaf.name == name:
                return leaf
        raise KeyError(f"no AccumulateGrad node for {name!r}; leaves: {[l.name for l in self.leaves]}")

    def contributors(self, name: str) -> list[str]:
        """Names of the backward nodes that feed ``name``'s ``.grad``."""
        return [self.nodes[i] for i, _ in self.leaf(name).contributors]

    def text(self) -> str:
        lines = [
            f"autograd graph: {len(self.nodes)} nodes, {len(self.edges)} edges, "
            f"{len(self.leaves)} AccumulateGrad nodes"
        ]
        for leaf in self.leaves:
            shape = "x".join(map(str, leaf.shape)) or "scalar"
            k = len(leaf.contributors)
            who = ", ".join(
                f"{self.nodes[i]}#{i}" + (f" (x{e} edges)" if e > 1 else "") for i, e in leaf.contributors
            )
            lines.append(f"  {leaf.name} [{shape}]: {k} contributor{'s' if k != 1 else ''}: {who}")
        return "\n".join(lines)

    def dot(self) -> str:
        """Graphviz DOT: the loss at the top, AccumulateGrad nodes (leaves) at the bottom."""
        leaf_at = {leaf.node: leaf for leaf in self.leaves}
        out = ["digraph autograd {", '  node [shape=box, fontname="Helvetica", fontsize=10];']
        for i, name in enumerate(self.nodes):
            if i in leaf_at:
                leaf = leaf_at[i]
                shape = "x".join(map(str, leaf.shape)) or "scalar"
                color = "orange" if len(leaf.contributors) > 1 else "lightblue"
                label = f"AccumulateGrad\\n{_escape(leaf.name)} [{shape}]"
                out.append(f'  n{i} [label="{label}", shape=ellipse, style=filled, fillcolor={color}];')
            elif name.startswith("CompiledFunction"):
                out.append(f'  n{i} [label="{_escape(name)}\\n(compiled graph)", style=filled, fillcolor=lightgrey];')
            else:
                out.append(f'  n{i} [label="{_escape(name)}"];')
        for a, b in self.edges:
            out.append(f"  n{a} -> n{b};")
        out.append("}")
        return "\n".join(out) + "\n"

    def render(self, path: str) -> Optional[str]:
        """Writes a PNG with Graphviz's ``dot``; returns the path, or None if ``dot`` is absent."""
        exe = shutil.which("dot")
        if exe is None:
            log.warning("Graphviz `dot` not found (Debian: apt-get install graphviz); no PNG written")
            return None
        subprocess.run([exe, "-Tpng", "-o", path], input=self.dot().encode(), check=True)
        return path

    def to_dict(self) -> dict:
        return {
            "nodes": list(self.nodes),
            "edges": [list(e) for e in self.edges],
            "leaves": [leaf.to_dict(self) for leaf in self.leaves],
        }


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def autograd_graph(
    roots: Union[torch.Tensor, Sequence[torch.Tensor]], names: Names = None
) -> GradGraph:
    """Walks the autograd graph behind ``roots`` (e.g. a loss).

    ``names``: a module (its ``named_parameters``) or a name-to-tensor mapping
    for naming leaves; leaves not named there are looked up among live modules
    (:func:`leaf_names`), then called ``tensor<i>``.
    """
    roots = [roots] if isinstance(roots, torch.Tensor) else list(roots)
    index: dict[object, int] = {}
    nodes: list[str] = []
    edges: list[tuple[int, int]] = []
    queue: collections.deque = collections.deque()

    def visit(fn) -> int:
        if fn not in index:
            index[fn] = len(nodes)
            nodes.append(fn.name())
            queue.append(fn)
        return index[fn]

    for r in roots:
        if r.grad_fn is not None:
            visit(r.grad_fn)
    leaf_nodes = []
    while queue:
        fn = queue.popleft()
        i = index[fn]
        if type(fn) is _AccumulateGrad:
            leaf_nodes.append(fn)
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                edges.append((i, visit(nxt)))
    tensors = [fn.variable for fn in leaf_nodes]
    leaf_name = leaf_names(tensors, names)
    into = collections.defaultdict(collections.Counter)
    for a, b in edges:
        into[b][a] += 1
    leaves = [
        Leaf(index[fn], leaf_name[k], tuple(fn.variable.shape), sorted(into[index[fn]].items()))
        for k, fn in enumerate(leaf_nodes)
    ]
    return GradGraph(nodes, edges, leaves)


def accumulate_grad_leaves(roots: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves whose ``.grad`` a backward from ``roots`` accumulates into."""
    return backward_nodes(roots)[0]


def backward_nodes(roots: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """The leaves a backward from ``roots`` accumulates into, and whether a compiled graph's node is on the way."""
    seen, leaves, stack = set(), [], [r.grad_fn for r in roots if r.grad_fn is not None]
    compiled = False
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if type(fn) is _AccumulateGrad:
            leaves.append(fn.variable)
        compiled = compiled or type(fn).__name__.startswith("CompiledFunction")
        stack.extend(n for n, _ in fn.next_functions if n is not None)
    return leaves, compiled


def leaf_names(tensors: Sequence[torch.Tensor], names: Names = None) -> list[str]:
    """A name per tensor: from ``names``, else from the live module that owns most of them.

    The fallback scans the garbage collector's objects for ``nn.Module``s, once
    per call and only if a tensor to name is an ``nn.Parameter`` (inputs that
    require grad are named ``tensor<i>`` without it); it takes a fraction of a
    second: for reports, not for every training step.
    """
    found = WeakIdKeyDictionary()
    if isinstance(names, nn.Module):
        names = dict(names.named_parameters())
    for name, t in (names or {}).items():
        found[t] = name
    missing = [t for t in tensors if t not in found]
    if any(isinstance(t, nn.Parameter) for t in missing):
        best, best_hits = None, 0
        wanted = {id(t) for t in missing}
        for obj in _private.live_objects(nn.Module):  # (it silences isinstance's deprecation warnings)
            hits = sum(id(p) in wanted for p in obj.parameters())
            if hits > best_hits:
                best, best_hits = obj, hits
        if best is not None:
            for name, p in best.named_parameters():
                if id(p) in wanted and p not in found:
                    found[p] = name
    out, k = [], 0
    for t in tensors:
        if t in found:
            out.append(found[t])
        else:
            out.append(f"tensor{k}")
            k += 1
    return out
