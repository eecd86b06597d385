"""The training loop of the original report, unchanged but for the backend string.

A 3-layer MLP whose input ``data`` requires grad, the forward and loss compiled,
SGD with momentum with its step compiled by the same backend,
``zero_grad(set_to_none=False)``, and ``data.grad`` read after every backward.
Under upstream ``openxla`` the steady step runs 6 XLA executions; explain it with

    PJRT_DEVICE=CPU python -m torch_xla_bridge.explain examples/original_report.py --steps 3
    PJRT_DEVICE=CPU python -m torch_xla_bridge.explain examples/original_report.py --steps 3 --backend openxla_fused_grad
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="openxla")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    if args.backend == "openxla_fused_grad":
        import torch_xla_bridge  # noqa: F401  (the entry point registers it too, once installed)

    dev = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.compile(lambda x, y: F.mse_loss(model(x), y), backend=args.backend)
    opt_step = torch.compile(opt.step, backend=args.backend)
    data = torch.randn(8, 16).to(dev).requires_grad_(True)
    target = torch.randn(8, 4).to(dev)
    losses = []
    for _ in range(args.iters):
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(data, target)
        loss.backward()
        data_grad = data.grad.cpu()  # the read that the original report saw execute
        opt_step()
        losses.append(loss.item())
    print(f"losses: {[round(v, 6) for v in losses]}; |data.grad| = {data_grad.norm():.6f}")
    return losses


if __name__ == "__main__":
    main()
