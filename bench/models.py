"""Benchmark models with synthetic data: a deep MLP, ResNet-18, a small GPT-2, a bank of tiny parameters."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class Workload:
    """A model and a loss over synthetic batches (built on CPU, moved by the caller)."""

    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, ...]]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


def _classify(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def mlp(depth: int, width: int, batch: int = 64) -> Workload:
    def make() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 10))

    def data(g: torch.Generator):
        return torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)

    return Workload(f"mlp{depth}x{width}", make, data, _classify)


def resnet18(batch: int = 4, size: int = 32) -> Workload:
    import torchvision

    def data(g: torch.Generator):
        return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g)

    return Workload("resnet18", lambda: torchvision.models.resnet18(num_classes=10), data, _classify)


def gpt2(layers: int = 2, dim: int = 64, seq: int = 32, batch: int = 2) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    # Dropout off: the backends draw random numbers in different orders, and
    # their losses are compared.
    config = GPT2Config(
        n_layer=layers, n_head=2, n_embd=dim, vocab_size=256, n_positions=seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )

    def data(g: torch.Generator):
        return (torch.randint(0, 256, (batch, seq), generator=g),)

    def loss(model: nn.Module, batch_: tuple[torch.Tensor, ...]) -> torch.Tensor:
        (ids,) = batch_
        return model(input_ids=ids, labels=ids).loss

    return Workload(f"gpt2-{layers}L", lambda: GPT2LMHeadModel(config), data, loss)


class ParameterBank(nn.Module):
    """`n` parameter tensors of 16 values each, all used by one matmul: many leaves, little math."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(16) * 0.1) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.stack(list(self.weights)).t()


def parameter_bank(n: int, batch: int = 8) -> Workload:
    def data(g: torch.Generator):
        return torch.randn(batch, 16, generator=g), torch.randint(0, n, (batch,), generator=g)

    return Workload(f"bank{n}", lambda: ParameterBank(n), data, _classify)


def by_name(name: str) -> Workload:
    """Parses names such as ``mlp32x256`` (``mlp2x1024b4096``: batch 4096), ``resnet18``, ``gpt2-2L``
    (``gpt2-4L-d256-s128-b4``: width, sequence length, batch), ``bank1000``."""
    if name.startswith("mlp"):
        shape, _, batch = name[3:].partition("b")
        depth, width = shape.split("x")
        if batch:
            w = mlp(int(depth), int(width), int(batch))
            w.name = name
            return w
        return mlp(int(depth), int(width))
    if name == "resnet18":
        return resnet18()
    if name.startswith("gpt2-"):
        # gpt2-2L, or with its shape: gpt2-4L-d256-s128-b4 (width, sequence length, batch).
        layers, *shape = name[5:].split("-")
        sizes = {part[0]: int(part[1:]) for part in shape}
        w = gpt2(layers=int(layers[:-1]), dim=sizes.get("d", 64), seq=sizes.get("s", 32), batch=sizes.get("b", 2))
        w.name = name
        return w
    if name.startswith("bank"):
        return parameter_bank(int(name[4:]))
    raise ValueError(f"unknown workload {name!r}")
