"""Step time of the project's backends against upstream `openxla` (and LazyTensor), in one run.

Identical models, one per mode, train side by side in one process, their
blocks of steps alternated, so machine noise hits all alike. Two timings per
loop:

- pipelined: blocks of `--block` steps with no wait between steps (as a
  training loop runs: the host may trace ahead while the device computes),
  timed from a drained device to a drained device, divided by the block size;
- synchronous: every step ends with `xm.wait_device_ops()`.

Reported: median step time (wall and process CPU) per mode, each mode's
ratio of medians to `openxla` and to `lazy` (when measured), the median of
per-block ratios to `openxla` (blocks that ran back to back), and executions
per step.

    PJRT_DEVICE=CPU python -m bench.step_time [--workload mlp32x256] [--modes openxla,openxla_fused_grad]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch._dynamo  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

from bench.loops import LOOPS, STEP_TIME_LOOPS  # noqa: E402
from bench.worker import MODES, build_step  # noqa: E402
from torch_xla_bridge.counting import executions  # noqa: E402
from torch_xla_bridge.names import BACKEND_NAME, UPSTREAM_BACKEND_NAME  # noqa: E402

BASELINE = UPSTREAM_BACKEND_NAME


class Trainer:
    """One mode's training step on a workload of bench/models.py."""

    def __init__(self, mode: str, workload: str, loop: str) -> None:
        self.step, _ = build_step(dict(workload=workload, mode=mode, loop=loop))
        self.execs: list[int] = []

    def block(self, steps: int, wait_each_step: bool) -> tuple[float, float]:
        """Runs `steps` steps from a drained device; returns wall and process CPU seconds per step.

        CPU time counts the host thread and PJRT CPU's compute threads alike:
        the work a step costs, which other processes on the machine inflate
        far less than its wall time.
        """
        xm.wait_device_ops()
        e0 = executions(wait=False)  # waited for just above, before the clock starts
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
            if wait_each_step:
                xm.wait_device_ops()
        xm.wait_device_ops()
        self.execs.append((executions(wait=False) - e0) // steps)
        return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def measure(trainers: dict[str, Trainer], blocks: int, block: int, wait_each_step: bool) -> dict:
    modes = list(trainers)
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(blocks):
        # Alternate the order so that no mode always follows the same one.
        for m in modes if i % 2 == 0 else modes[::-1]:
            wall, cpu_s = trainers[m].block(block, wait_each_step)
            times[m].append(wall)
            cpu[m].append(cpu_s)
    med = {m: statistics.median(t) for m, t in times.items()}
    med_cpu = {m: statistics.median(t) for m, t in cpu.items()}
    out = dict(median_ms={m: round(1e3 * v, 3) for m, v in med.items()},
               median_cpu_ms={m: round(1e3 * v, 3) for m, v in med_cpu.items()})
    for ref in (BASELINE, "lazy"):
        if ref in med:
            out[f"ratio_to_{ref}"] = {m: round(v / med[ref], 3) for m, v in med.items() if m != ref}
            out[f"cpu_ratio_to_{ref}"] = {m: round(v / med_cpu[ref], 3) for m, v in med_cpu.items() if m != ref}
    if BASELINE in times:
        out[f"median_block_ratio_to_{BASELINE}"] = {
            m: round(statistics.median(a / b for a, b in zip(t, times[BASELINE], strict=True)), 3)
            for m, t in times.items() if m != BASELINE
        }
    return out


def run(workload: str, modes: list[str], loops: list[str], blocks: int, block: int, warmup: int) -> list[dict]:
    rows = []
    for loop in loops:
        # A fresh dynamo per loop: the trainers of all loops share their functions' code
        # objects, and their compiles together would pass dynamo's recompile limit.
        torch._dynamo.reset()
        trainers = {m: Trainer(m, workload, loop) for m in modes}
        for t in trainers.values():
            t.block(warmup, wait_each_step=True)
            t.execs.clear()
        for timing, wait_each_step in (("pipelined", False), ("synchronous", True)):
            row = dict(loop=LOOPS[loop].label, timing=timing, workload=workload, steps=blocks * block)
            row.update(measure(trainers, blocks, block, wait_each_step))
            row["executions_per_step"] = {m: statistics.mode(t.execs) for m, t in trainers.items()}
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mlp32x256", help="a workload of bench/models.py")
    ap.add_argument("--modes", default=f"{BASELINE},{BACKEND_NAME}", help=f"comma-separated, from {MODES}")
    ap.add_argument("--loops", default=",".join(STEP_TIME_LOOPS), help=f"comma-separated, from {STEP_TIME_LOOPS}")
    ap.add_argument("--blocks", type=int, default=24, help="timed blocks per mode and timing")
    ap.add_argument("--block", type=int, default=5, help="steps per block")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    modes, loops = args.modes.split(","), args.loops.split(",")
    unknown = [m for m in modes if m not in MODES] + [lp for lp in loops if lp not in STEP_TIME_LOOPS]
    if unknown:
        ap.error(f"unknown modes or loops {unknown}; modes: {MODES}, loops: {STEP_TIME_LOOPS}")
    rows = run(args.workload, modes, loops, args.blocks, args.block, args.warmup)
    print(f"{args.workload}, SGD(momentum), {args.blocks} blocks of {args.block} steps per mode and timing, "
          f"alternated, on {torch_xla.device()}")
    for r in rows:
        print(f"{r['loop']} | {r['timing']}")
        for m in modes:
            ratios = " ".join(f"{k}={r[k][m]:.3f}" for k in r if "ratio_to_" in k and m in r[k])
            print(f"  {m:20} {r['median_ms'][m]:8.3f} ms  cpu {r['median_cpu_ms'][m]:8.3f} ms  "
                  f"execs/step {r['executions_per_step'][m]}  {ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
