"""A torchvision ResNet-18 training loop on synthetic images, compiled for XLA.

The loop is the one users already run; the backend string is the only change
between upstream and fused gradients:

    PJRT_DEVICE=CPU python examples/train_resnet.py --backend openxla
    PJRT_DEVICE=CPU python examples/train_resnet.py --backend openxla_fused_grad
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torchvision  # noqa: E402


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="openxla_fused_grad")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=32)
    args = ap.parse_args(argv)

    device = torch_xla.device()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    compiled = torch.compile(model, backend=args.backend)

    g = torch.Generator().manual_seed(0)
    images = torch.randn(args.steps, args.batch, 3, args.image, args.image, generator=g)
    labels = torch.randint(0, 10, (args.steps, args.batch), generator=g)

    losses = []
    model.train()
    for step in range(args.steps):
        x, y = images[step].to(device), labels[step].to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        torch_xla.sync()
        losses.append(loss.item())
        print(f"step {step + 1}: loss {losses[-1]:.5f}")
    return losses


if __name__ == "__main__":
    main()
