"""SPMD benchmark: `openxla_fused_grad` against upstream `openxla` on a 4-device mesh.

Runs as its own process (SPMD must be on before the first device use):

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python -m bench.spmd [--depth 8] [--width 256] [--blocks 12]

Two layouts of an MLP (bench/models.py), batch 64 split over the mesh:

- data parallel: parameters replicated;
- parameter-sharded (FSDP-style): each parameter split along its largest
  dimension, the rule of torch_xla's SpmdFullyShardedDataParallel;

and two loops (SGD with momentum, ``zero_grad(set_to_none=False)``, 4
distinct batches in turn): the
optimizer compiled with the same backend, or eager followed by ``xm.mark_step()``.
Both backends train identical models side by side in one process, alternating
(bench/step_time.py's timing), and report executions per step, median step
times, their ratio (ours / upstream), the median of per-block ratios and the
ratio of process CPU time, and how far the two models' parameters drifted apart. Then each backend trains through a batch-layout change after 7
steps, past upstream's 5-call sharding check, and reports whether it survived.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from typing import Any, Callable

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before anything touches a device

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

import torch_xla_bridge  # noqa: E402,F401
from bench.loops import LOOPS, SPMD_LOOPS, Loop  # noqa: E402
from bench.models import mlp  # noqa: E402
from bench.step_time import Trainer, measure  # noqa: E402
from torch_xla_bridge.names import BACKEND_NAME, UPSTREAM_BACKEND_NAME  # noqa: E402

BACKENDS = (UPSTREAM_BACKEND_NAME, BACKEND_NAME)
LAYOUTS = ("data parallel", "parameter-sharded")
BATCHES = 4  # distinct batches, cycled


def mesh() -> xs.Mesh:
    n = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(n), (n,), ("data",))


def shard_largest_dim(model: torch.nn.Module, m: xs.Mesh) -> None:
    for p in model.parameters():
        spec: list[Any] = [None] * p.dim()
        spec[list(p.shape).index(max(p.shape))] = "data"
        xs.mark_sharding(p, m, tuple(spec))


class SpmdTrainer(Trainer):
    """One backend's training step on a sharded MLP; timed by bench/step_time.py's ``block``."""

    def __init__(self, backend: str, depth: int, width: int, layout: str, loop: Loop) -> None:
        # Not Trainer.__init__: that builds a single-device workload of
        # bench/worker.py; `block` needs only `step` and `execs`.
        m = mesh()
        workload = mlp(depth, width)
        torch.manual_seed(0)
        self.model = workload.make_model().to(torch_xla.device())
        if layout == "parameter-sharded":
            shard_largest_dim(self.model, m)
        opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        g = torch.Generator().manual_seed(0)
        batches = [tuple(t.to(torch_xla.device()) for t in workload.make_batch(g)) for _ in range(BATCHES)]
        for x, y in batches:
            xs.mark_sharding(x, m, ("data", None))
            xs.mark_sharding(y, m, ("data",))
        fwd = torch.compile(lambda x, y: workload.loss(self.model, (x, y)), backend=backend)
        opt_step = torch.compile(opt.step, backend=backend) if loop.compiled_optimizer else opt.step
        steps = itertools.count()

        def step() -> None:
            opt.zero_grad(set_to_none=loop.set_to_none)
            fwd(*batches[next(steps) % BATCHES]).backward()
            opt_step()
            if not loop.compiled_optimizer:
                xm.mark_step()

        self.step: Callable[[], None] = step
        self.execs: list[int] = []


def timings(depth: int, width: int, blocks: int, block: int, warmup: int) -> list[dict]:
    rows = []
    for layout in LAYOUTS:
        for loop in (LOOPS[name] for name in SPMD_LOOPS):
            torch._dynamo.reset()
            trainers = {b: SpmdTrainer(b, depth, width, layout, loop) for b in BACKENDS}
            for t in trainers.values():
                t.block(warmup, wait_each_step=True)
                t.execs.clear()
            row: dict[str, Any] = dict(layout=layout, loop=loop.optimizer, depth=depth, width=width, steps=blocks * block)
            row.update(measure(trainers, blocks, block, wait_each_step=False))
            row["executions_per_step"] = {b: statistics.mode(t.execs) for b, t in trainers.items()}
            up, ours = (list(trainers[b].model.parameters()) for b in BACKENDS)
            row["max_param_diff"] = max((a.cpu() - b.cpu()).abs().max().item() for a, b in zip(up, ours, strict=True))
            rows.append(row)
    return rows


def layout_change(backend: str, steps_before: int = 7, steps_after: int = 3) -> str:
    """Trains through a change of the batch layout; "ok" or the error that stopped it."""
    torch._dynamo.reset()
    m1, m2 = mesh(), xs.Mesh(np.arange(4), (2, 2), ("a", "b"))
    workload = mlp(2, 32, batch=8)
    torch.manual_seed(0)
    model = workload.make_model().to(torch_xla.device())
    fwd = torch.compile(lambda x, y: workload.loss(model, (x, y)), backend=backend)
    g = torch.Generator().manual_seed(0)
    try:
        for i in range(steps_before + steps_after):
            x, y = (t.to(torch_xla.device()) for t in workload.make_batch(g))
            if i < steps_before:
                xs.mark_sharding(x, m1, ("data", None))
            else:
                xs.mark_sharding(x, m2, ("b", "a"))
            model.zero_grad()
            fwd(x, y).backward()
            xm.wait_device_ops()
        return "ok"
    except RuntimeError as e:
        return str(e).splitlines()[0][:160]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=12, help="timed blocks per backend and row")
    ap.add_argument("--block", type=int, default=5, help="steps per block")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    rows = timings(args.depth, args.width, args.blocks, args.block, args.warmup)
    # Ours first: upstream's failure leaves the runtime unusable for this process.
    changes = {b: layout_change(b) for b in reversed(BACKENDS)}
    print(f"{args.depth}-layer MLP, width {args.width}, batch 64 over {xr.global_runtime_device_count()} "
          f"SPMD devices, SGD(momentum), {args.blocks} blocks of {args.block} steps per backend, alternated, pipelined")
    up, ours = BACKENDS
    print(f"{'layout':17} | {'loop':27} | {'openxla ms':>10} | {'fused ms':>9} | {'ratio':>6} | {'block ratio':>11} | "
          f"{'cpu ratio':>9} | execs/step | max |param diff|")
    for r in rows:
        m, e = r["median_ms"], r["executions_per_step"]
        print(f"{r['layout']:17} | {r['loop']:27} | {m[up]:10.3f} | {m[ours]:9.3f} | "
              f"{r[f'ratio_to_{up}'][ours]:6.3f} | {r[f'median_block_ratio_to_{up}'][ours]:11.3f} | "
              f"{r[f'cpu_ratio_to_{up}'][ours]:9.3f} | {e[up]} -> {e[ours]:<5} | {r['max_param_diff']:.3g}")
    for b, outcome in changes.items():
        print(f"batch layout change after 7 steps, {b}: {outcome}")
    if args.json:
        # Keeps what bench.llama_spmd wrote into the same file ("llama").
        data = json.loads(open(args.json).read()) if os.path.exists(args.json) else {}
        data.update(rows=rows, layout_change=changes)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)


if __name__ == "__main__":
    main()
