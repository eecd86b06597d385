"""Where a step's host time goes, phase by phase, and whether the device still runs when the step returns.

One mode and loop (a loop of bench/loops.py) on a workload of bench/models.py.
Each steady step starts from an idle device (`xm.wait_device_ops()` before it)
and is timed per phase: `zero_grad`, the micro-batches' forwards and
backwards (each summed), the optimizer step, the user's `xm.mark_step()` after
it (every loop here ends with one, as pytorch/xla's examples and most TPU
scripts do), and `after`: the wait for the device (`xm.wait_device_ops()`).
Per phase it also counts the executions that *completed* within it (torch_xla
records an execution when it finishes): a step whose host overlaps the device
has its executions complete in `after`, none in `opt.step()` or `mark_step`.

`--check` runs the loops of :data:`CHECKS` on :data:`CHECK_WORKLOAD`, whose
step takes a few hundred milliseconds of device time on PJRT CPU, against a
few of host time: an execution that completes before `after` means a phase
waited for it (the step's call, or the user's sync after it), which fails the
check, and so does any number of executions per step other than the expected
one. `--spmd` runs the same on a virtual mesh of 4 devices (parameters and
batch sharded FSDP-style). `python -m bench` runs both checks.

    PJRT_DEVICE=CPU python -m bench.phases --mode openxla_fused_step --loop zero_grads
    PJRT_DEVICE=CPU python -m bench.phases --table          # mlp32x256, every mode x loop, a process each
    PJRT_DEVICE=CPU python -m bench.phases --check [--spmd]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Iterable

os.environ.setdefault("PJRT_DEVICE", "CPU")

PHASES = ("zero_grad", "forward", "backward", "opt.step()", "mark_step", "after")
TABLE_MODES = ("openxla", "openxla_fused_grad", "openxla_fused_step")
TABLE_LOOPS = ("zero_grads", "eager_optimizer", "accumulate4")
# Device-bound: about 0.3-0.6 s of device time per micro-batch on 2 CPU cores, a few ms of host time.
CHECK_WORKLOAD = "mlp2x1024b4096"
# (mode, loop, micro-batches): the loops whose step must run while Python goes on.
CHECKS = (
    ("openxla_fused_step", "zero_grads", 1),
    ("openxla_fused_step", "eager_optimizer", 1),
    ("openxla_fused_step", "accumulate4", 2),
    ("openxla_fused_grad", "zero_grads", 1),
    ("openxla_fused_grad", "eager_optimizer", 1),
)
SPMD_CHECKS = CHECKS[:3]  # openxla_fused_grad's optimizer under SPMD is upstream's graph (see docs/benchmarks.md)


def expected_executions(mode: str, micro: int) -> int:
    """Executions per step of the fused backends: one for the fused step; per micro-batch a forward
    and a backward, then the optimizer's, for openxla_fused_grad."""
    return 1 if mode == "openxla_fused_step" else 2 * micro + 1


def measure(mode: str, loop_name: str, workload_name: str, warmup: int, steps: int, micro: int | None = None,
            spmd: bool = False) -> dict[str, Any]:
    """Per steady step: the seconds spent in each phase and the executions completed in it; with medians."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_bridge  # noqa: F401  (registers the backends)
    from bench.loops import LOOPS
    from bench.models import by_name
    from torch_xla_bridge.counting import executions

    loop = LOOPS[loop_name]
    micro = micro or loop.micro
    workload = by_name(workload_name)
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = workload.make_model().to(dev).train()
    g = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(dev) for t in workload.make_batch(g)) for _ in range(micro)]
    if spmd:
        _shard(model, batches)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def loss_of(*batch: torch.Tensor) -> torch.Tensor:
        return workload.loss(model, batch) / micro

    fwd = torch.compile(loss_of, backend=mode)
    opt_step: Callable[[], Any] = torch.compile(opt.step, backend=mode) if loop.compiled_optimizer else opt.step

    seconds: dict[str, list[float]] = {p: [] for p in PHASES}
    completed: dict[str, list[int]] = {p: [] for p in PHASES}
    for i in range(warmup + steps):
        xm.wait_device_ops()
        spent = dict.fromkeys(PHASES, 0.0)
        done = dict.fromkeys(PHASES, 0)

        def phase(name: str, fn: Callable[[], Any]) -> Any:
            e0, t0 = executions(wait=False), time.perf_counter()
            out = fn()
            spent[name] += time.perf_counter() - t0
            done[name] += executions(wait=False) - e0
            return out

        phase("zero_grad", lambda: opt.zero_grad(set_to_none=loop.set_to_none))
        for batch in batches:
            loss = phase("forward", lambda: fwd(*batch))
            phase("backward", loss.backward)
        phase("opt.step()", opt_step)
        with warnings.catch_warnings():  # its deprecation in favour of torch_xla.sync(), the same barrier
            warnings.simplefilter("ignore", DeprecationWarning)
            phase("mark_step", xm.mark_step)
        phase("after", xm.wait_device_ops)
        if i >= warmup:
            for p in PHASES:
                seconds[p].append(spent[p])
                completed[p].append(done[p])
    return dict(
        mode=mode, loop=loop_name, micro=micro, workload=workload_name, spmd=spmd, steps=steps,
        ms={p: round(1e3 * statistics.median(seconds[p]), 2) for p in PHASES},
        completed={p: statistics.median_low(completed[p]) for p in PHASES},
        per_step={p: completed[p] for p in PHASES},
    )


def _shard(model: Any, batches: list[tuple]) -> None:
    """FSDP-style on a 1-D mesh of every device: each weight's rows and each batch's first dimension."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    for p in model.parameters():
        if p.dim() == 2 and p.shape[0] % n == 0:
            xs.mark_sharding(p, mesh, ("fsdp", None))
    for batch in batches:
        for t in batch:
            xs.mark_sharding(t, mesh, ("fsdp",) + (None,) * (t.dim() - 1))


def overlap_failures(r: dict[str, Any]) -> list[str]:
    """Why a checked step did not run while Python went on (empty: it did)."""
    why = [f"an execution completed during {p} in steady step(s) {[i for i, n in enumerate(r['per_step'][p]) if n]}"
           for p in PHASES[:-1] if any(r["per_step"][p])]
    want = expected_executions(r["mode"], r["micro"])
    got = [sum(r["per_step"][p][i] for p in PHASES) for i in range(r["steps"])]
    if any(n != want for n in got):
        why.append(f"executions per step {got}, expected {want}")
    return why


def row(r: dict[str, Any]) -> str:
    cells = [f"{r['ms'][p]:.1f} / {r['completed'][p]}" for p in PHASES]
    return f"| {r['mode']} | {r['loop']} | " + " | ".join(cells) + " |"


def header() -> str:
    return "| mode | loop | " + " | ".join(PHASES) + " |\n|---|---|" + "---|" * len(PHASES)


def _use_spmd() -> None:
    """SPMD on a virtual mesh of 4 CPU devices (unless CPU_NUM_DEVICES says otherwise), before any device is used."""
    os.environ.setdefault("CPU_NUM_DEVICES", "4")
    import torch_xla.runtime as xr

    xr.use_spmd()


def check(spmd: bool, warmup: int = 2, steps: int = 3) -> int:
    """Runs :data:`CHECKS` (:data:`SPMD_CHECKS`) in this process; prints a table and each failure; 1 if any."""
    if spmd:
        _use_spmd()
    import torch._dynamo

    failures = 0
    print(header())
    for mode, loop, micro in SPMD_CHECKS if spmd else CHECKS:
        torch._dynamo.reset()
        r = measure(mode, loop, CHECK_WORKLOAD, warmup, steps, micro=micro, spmd=spmd)
        print(row(r) + (f" x{micro}" if micro > 1 else ""), flush=True)
        for why in overlap_failures(r):
            failures += 1
            print(f"FAILED asynchrony{' (SPMD)' if spmd else ''}: {mode} {loop} x{micro}: {why}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="openxla_fused_step")
    ap.add_argument("--loop", default="zero_grads")
    ap.add_argument("--workload", default="mlp32x256")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--table", action="store_true", help=f"{TABLE_MODES} x {TABLE_LOOPS}, a process each")
    ap.add_argument("--check", action="store_true", help="fail unless the checked steps overlap host and device")
    ap.add_argument("--spmd", action="store_true", help="on a virtual mesh of 4 devices, FSDP-style (not --table)")
    args = ap.parse_args(argv)
    if args.check:
        sys.exit(check(args.spmd))
    if not args.table:
        if args.spmd:
            _use_spmd()
        print(json.dumps(measure(args.mode, args.loop, args.workload, args.warmup, args.steps, spmd=args.spmd)))
        return
    print(header())
    for loop in TABLE_LOOPS:
        for mode in TABLE_MODES:
            cmd = [sys.executable, "-m", "bench.phases", "--mode", mode, "--loop", loop, "--workload",
                   args.workload, "--warmup", str(args.warmup), "--steps", str(args.steps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            print(row(json.loads(out.strip().splitlines()[-1])), flush=True)


if __name__ == "__main__":
    main()
