"""Host scalars in a deferred graph: 0-dim CPU tensors among its inputs and outputs.

torch's optimizers keep each parameter's ``step`` as a 0-dim CPU tensor
unless ``capturable=True``, and torch's idiom for a scheduler under
``torch.compile`` is a 0-dim CPU tensor ``lr``. A compiled optimizer step
then gives AOTAutograd a graph that reads such tensors and, for the step
counts, returns new ones (AOTAutograd writes them back into the counts).
XLA cannot return a CPU tensor, so such a graph is split (:func:`split`):

- its CPU outputs are computed on the host, by the slice of the graph that
  produces them (``step + 1``), which reads host inputs only;
- everything else is the device graph, lowered to XLA; it reads the host
  inputs as device values (the caller transfers them per call, see
  :mod:`torch_xla_bridge.deferred`), so a new ``lr`` or count is new data
  for the same computation, never a new compilation.

This module imports no other stage of the package.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional, Sequence, Union

import torch


def is_host_scalar(t: Any) -> bool:
    """A 0-dim CPU tensor: the only off-device tensor a deferred graph takes (see the module docstring)."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() == 0


@dataclasses.dataclass(frozen=True)
class HostSplit:
    """A graph whose CPU outputs come from the host.

    Invariants: ``device_gm`` is the graph with the output at each position in
    ``host_outputs`` replaced by ``None`` (and the ops only those needed
    removed); ``host_gm`` takes the graph's arguments and returns exactly those
    outputs, in that order, computed from CPU inputs and constants alone.
    """

    device_gm: torch.fx.GraphModule
    host_gm: torch.fx.GraphModule
    host_outputs: tuple[int, ...]

    def host_values(self, args: Sequence[Any]) -> list[torch.Tensor]:
        """The host outputs for ``args`` (a few scalar ops on the CPU, no XLA work)."""
        with torch.no_grad():
            return list(self.host_gm(*args))

    def merge(self, outs: list[Any], host: Sequence[torch.Tensor]) -> list[Any]:
        """The graph's outputs: ``outs`` of the device graph with the host outputs in their places."""
        for pos, value in zip(self.host_outputs, host):
            outs[pos] = value
        return outs


def _val(node: torch.fx.Node) -> Any:
    return node.meta.get("val")


def _on_cpu(node: torch.fx.Node) -> bool:
    v = _val(node)
    return isinstance(v, torch.Tensor) and v.device.type == "cpu"


def split(gm: torch.fx.GraphModule) -> Union[HostSplit, str, None]:
    """Splits off ``gm``'s CPU outputs: a :class:`HostSplit`, None if it has none, or why it cannot be split.

    It cannot where a CPU output depends on a value computed on the device
    (a ``.cpu()`` of a device tensor): that needs an execution to produce.
    """
    out_node = gm.graph.output_node()
    outs = out_node.args[0]
    flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    host_outputs = tuple(i for i, o in enumerate(flat) if isinstance(o, torch.fx.Node) and _on_cpu(o))
    if not host_outputs:
        return None
    # The backward slice of the CPU outputs: every op in it must be a host op.
    needed: set[torch.fx.Node] = set()
    stack = [flat[i] for i in host_outputs]
    while stack:
        node = stack.pop()
        if node in needed:
            continue
        needed.add(node)
        # A device input counts too: ``t.cpu()`` of an argument needs an execution as much as of a result.
        if not _on_cpu(node) and isinstance(_val(node), torch.Tensor):
            return f"it returns a CPU tensor computed from device values ({node.format_node()})"
        stack.extend(node.all_input_nodes)
    host = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" or (node in needed and node.op != "output"):
            env[node] = host.node_copy(node, lambda n: env[n])
    host.output(tuple(env[flat[i]] for i in host_outputs))
    device_gm = copy.deepcopy(gm)
    device_out = device_gm.graph.output_node()
    device_flat = list(device_out.args[0]) if isinstance(outs, (list, tuple)) else [device_out.args[0]]
    for i in host_outputs:
        device_flat[i] = None
    device_out.args = (type(outs)(device_flat) if isinstance(outs, (list, tuple)) else device_flat[0],)
    device_gm.graph.eliminate_dead_code()
    device_gm.recompile()
    return HostSplit(device_gm, torch.fx.GraphModule(gm, host), host_outputs)
