"""Trains one MLP with `openxla`, `openxla_fused_grad` and `openxla_fused_step`; prints XLA executions per step.

The training script is the same for both backends; only the backend string
changes, and `torch_xla_bridge` is never imported (the installed package's
`torch_dynamo_backends` entry point makes the name known to torch.compile).

    PJRT_DEVICE=CPU python examples/demo.py [--steps 8] [--depth 8] [--width 128]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

BACKENDS = ("openxla", "openxla_fused_grad", "openxla_fused_step")
LOOPS = {
    "zero_grad(set_to_none=False), compiled optimizer": dict(set_to_none=False, compiled_opt=True),
    "zero_grad(set_to_none=True), compiled optimizer": dict(set_to_none=True, compiled_opt=True),
    "eager optimizer + torch_xla.sync() (xm.mark_step())": dict(set_to_none=False, compiled_opt=False),
}


def executions() -> int:
    xm.wait_device_ops()
    data = met.metric_data("ExecuteTime")
    return data[0] if data else 0


def make_model(depth: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def train(backend: str, steps: int, depth: int, width: int, set_to_none: bool, compiled_opt: bool):
    # Each run compiles afresh, as its own training script would (and stays under dynamo's recompile limit).
    torch._dynamo.reset()
    dev = torch_xla.device()
    model = make_model(depth, width).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend=backend)
    opt_step = torch.compile(opt.step, backend=backend) if compiled_opt else opt.step
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(64, width, generator=g).to(dev), torch.randint(0, 10, (64,), generator=g).to(dev))
            for _ in range(steps)]
    torch_xla.sync()
    phases, losses, times = [], [], []
    for x, y in data:
        t0 = time.perf_counter()
        e0 = executions()
        opt.zero_grad(set_to_none=set_to_none)
        loss = loss_fn(x, y)
        e1 = executions()
        loss.backward()
        e2 = executions()
        opt_step()
        if not compiled_opt:
            torch_xla.sync()  # the same as xm.mark_step()
        e3 = executions()
        times.append(time.perf_counter() - t0)
        phases.append((e1 - e0, e2 - e1, e3 - e2))
        losses.append(loss.item())
    return phases, losses, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--width", type=int, default=128)
    args = ap.parse_args()
    print(f"{args.depth}-layer MLP, width {args.width}, batch 64, SGD(momentum), "
          f"{args.steps} steps on {torch_xla.device()} (torch {torch.__version__}, torch_xla {torch_xla.__version__})")
    print("executions per step = forward + backward + optimizer, counted with torch_xla.debug.metrics\n")
    for loop, kw in LOOPS.items():
        results = {b: train(b, args.steps, args.depth, args.width, **kw) for b in BACKENDS}
        print(f"loop: {loop}")
        print(f"  {'step':>4} | " + " | ".join(f"{b:>18}" for b in BACKENDS) + " | loss per backend")
        for i in range(args.steps):
            cells = []
            for b in BACKENDS:
                f, bw, o = results[b][0][i]
                cells.append(f"{f + bw + o} ({f}+{bw}+{o})")
            losses = " ".join(f"{results[b][1][i]:.6f}" for b in BACKENDS)
            print(f"  {i + 1:>4} | " + " | ".join(f"{c:>18}" for c in cells) + f" | {losses}")
        steady = {b: sum(map(sum, results[b][0][2:])) / max(1, args.steps - 2) for b in BACKENDS}
        print("  steady state (step 3 on): "
              + ", ".join(f"{b} {steady[b]:.0f}" for b in BACKENDS) + " executions per step\n")


if __name__ == "__main__":
    main()
