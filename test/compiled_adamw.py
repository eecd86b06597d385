"""A training script whose optimizer step is compiled: AdamW on a 3-layer MLP, no sync.

The loop of issue 21: ``opt_step = torch.compile(opt.step, backend=...)``,
``zero_grad(set_to_none=True)``, default (foreach) AdamW, which dynamo splits
into more than one graph, and nothing that syncs. ``--eager-forward`` leaves
the model uncompiled (its forward and backward run lazily). The tests run it
under ``torch_xla_bridge.explain`` (``run_script``) with each backend.

    python test/compiled_adamw.py [--backend B] [--iters N] [--eager-forward]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402

import torch_xla_bridge  # noqa: E402,F401  (registers the backends)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="openxla")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--eager-forward", action="store_true")
    args = ap.parse_args(argv)
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    forward = model if args.eager_forward else torch.compile(model, backend=args.backend)
    opt_step = torch.compile(opt.step, backend=args.backend)
    x, y = torch.randn(8, 16).to(dev), torch.randn(8, 4).to(dev)
    for _ in range(args.iters):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(forward(x), y).backward()
        opt_step()


if __name__ == "__main__":
    main()
