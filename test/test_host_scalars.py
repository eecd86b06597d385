"""host_scalars.split on small traced graphs (no XLA needed: "device" values are meta tensors here)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_xla_bridge import host_scalars


def adam_like(step: torch.Tensor, lr: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A step count updated on the host, a device update scaled by host scalars (as a compiled Adam)."""
    new_step = step + 1
    return new_step, p * (lr / (1 - 0.9**new_step))


def test_cpu_outputs_come_from_the_host_slice_and_the_rest_from_the_device_graph() -> None:
    step, lr, p = torch.tensor(3.0), torch.tensor(0.1), torch.ones(4, device="meta")
    gm = make_fx(adam_like, tracing_mode="fake")(step, lr, p)
    split = host_scalars.split(gm)
    assert isinstance(split, host_scalars.HostSplit)
    assert split.host_outputs == (0,)
    (host_step,) = split.host_values([step, lr, p])
    assert host_step.device.type == "cpu" and host_step.item() == 4.0
    # The device graph returns None where the host output was, and the update itself.
    p_cpu = torch.ones(4)
    none, update = split.device_gm(step, lr, p_cpu)
    assert none is None
    torch.testing.assert_close(update, adam_like(step, lr, p_cpu)[1])
    assert split.merge([None, update], [host_step])[0] is host_step
    # Only the host slice (step + 1) is in the host graph.
    host_ops = [n.target for n in split.host_gm.graph.nodes if n.op == "call_function"]
    assert host_ops == [torch.ops.aten.add.Tensor]


def test_a_graph_without_cpu_outputs_is_not_split() -> None:
    gm = make_fx(lambda lr, p: p * lr, tracing_mode="fake")(torch.tensor(0.1), torch.ones(4, device="meta"))
    assert host_scalars.split(gm) is None


def test_a_cpu_output_computed_from_device_values_cannot_be_split() -> None:
    gm = make_fx(lambda p: p.sum().cpu(), tracing_mode="fake")(torch.ones(4, device="meta"))
    reason = host_scalars.split(gm)
    assert isinstance(reason, str) and reason.startswith("it returns a CPU tensor computed from device values")
