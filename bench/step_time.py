"""Step time of `openxla_fused_grad` against upstream `openxla`, in one run.

Two identical models train side by side in one process, alternating, so
machine noise hits both alike. Two timings per loop:

- pipelined: blocks of `--block` steps with no wait between steps (as a
  training loop runs: the host may trace ahead while the device computes),
  timed from a drained device to a drained device, divided by the block size;
- synchronous: every step ends with `xm.wait_device_ops()`.

Reported: median step time per backend, the ratio of medians (ours /
upstream), the median of per-pair ratios (each pair ran back to back), and
executions per step.

    PJRT_DEVICE=CPU python -m bench.step_time [--depth 32] [--width 256] [--blocks 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

from bench.worker import build_step, executions  # noqa: E402

BACKENDS = ("openxla", "openxla_fused_grad")
# Display name -> the loop of bench/worker.py.
LOOPS = {
    "set_to_none=False, compiled optimizer": "zero_grads",
    "set_to_none=True, compiled optimizer": "set_to_none",
    "eager optimizer + mark_step": "eager_optimizer",
}


class Trainer:
    """One backend's training step on the MLP workload of bench/models.py."""

    def __init__(self, backend: str, depth: int, width: int, loop: str) -> None:
        self.step, _ = build_step(dict(workload=f"mlp{depth}x{width}", mode=backend, loop=loop))
        self.execs: list[int] = []

    def block(self, steps: int, wait_each_step: bool) -> float:
        """Runs `steps` steps from a drained device; returns seconds per step."""
        xm.wait_device_ops()
        e0 = executions()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
            if wait_each_step:
                xm.wait_device_ops()
        xm.wait_device_ops()
        self.execs.append((executions() - e0) // steps)
        return (time.perf_counter() - t0) / steps


def measure(trainers: dict[str, Trainer], blocks: int, block: int, wait_each_step: bool) -> dict:
    times: dict[str, list[float]] = {b: [] for b in trainers}
    for i in range(blocks):
        # Alternate which backend goes first so neither always follows the other.
        for b in BACKENDS if i % 2 == 0 else BACKENDS[::-1]:
            times[b].append(trainers[b].block(block, wait_each_step))
    med = {b: statistics.median(t) for b, t in times.items()}
    pair = [f / u for f, u in zip(times[BACKENDS[1]], times[BACKENDS[0]])]
    return dict(
        median_ms={b: round(1e3 * m, 3) for b, m in med.items()},
        ratio_of_medians=round(med[BACKENDS[1]] / med[BACKENDS[0]], 3),
        median_pair_ratio=round(statistics.median(pair), 3),
    )


def run(depth: int, width: int, blocks: int, block: int, warmup: int) -> list[dict]:
    rows = []
    for loop, kw in LOOPS.items():
        trainers = {b: Trainer(b, depth, width, kw) for b in BACKENDS}
        for t in trainers.values():
            t.block(warmup, wait_each_step=True)
            t.execs.clear()
        for mode, wait_each_step in (("pipelined", False), ("synchronous", True)):
            row = dict(loop=loop, mode=mode, depth=depth, width=width, steps=blocks * block)
            row.update(measure(trainers, blocks, block, wait_each_step))
            row["executions_per_step"] = {b: statistics.mode(t.execs) for b, t in trainers.items()}
            rows.append(row)
    return rows


TIMING_HEADER = f"{'openxla ms':>10} | {'fused ms':>9} | {'ratio':>6} | {'pair ratio':>10} | execs/step"


def timing_cells(row: dict) -> str:
    """A row's columns under ``TIMING_HEADER``."""
    m, e = row["median_ms"], row["executions_per_step"]
    return (f"{m['openxla']:10.3f} | {m['openxla_fused_grad']:9.3f} | {row['ratio_of_medians']:6.3f} | "
            f"{row['median_pair_ratio']:10.3f} | {e['openxla']} -> {e['openxla_fused_grad']}")


def parse_args(description: str, depth: int, blocks: int) -> argparse.Namespace:
    """The command line of an alternated MLP timing (here and in bench/spmd.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--depth", type=int, default=depth)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=blocks, help="timed blocks per backend and row")
    ap.add_argument("--block", type=int, default=5, help="steps per block")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", help="also write the results to this file")
    return ap.parse_args()


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], depth=32, blocks=24)
    rows = run(args.depth, args.width, args.blocks, args.block, args.warmup)
    print(f"{args.depth}-layer MLP, width {args.width}, batch 64, SGD(momentum), {args.blocks} blocks of "
          f"{args.block} steps per backend and mode, alternated, on {torch_xla.device()}")
    print(f"{'loop':38} | {'mode':11} | {TIMING_HEADER}")
    for r in rows:
        print(f"{r['loop']:38} | {r['mode']:11} | {timing_cells(r)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
