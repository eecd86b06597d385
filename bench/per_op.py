"""Host cost of the per-parameter lazy ops a training loop asks for, and the floor they put under a step.

A loop written as users write it (``optimizer.zero_grad(set_to_none=False)``,
``loss.backward()``, a compiled ``optimizer.step()``) makes, for every
parameter, ops that reach torch_xla one tensor at a time whatever the backend
does with its graphs:

- ``zero_``: ``zero_grad`` clears each ``.grad``;
- ``accumulate``: the autograd engine's AccumulateGrad adds each new gradient
  into ``.grad`` in place;
- ``param write-back`` / ``state write-back``: AOTAutograd writes the compiled
  optimizer's new values back into each parameter (``p.detach().copy_``) and
  each state tensor (momentum, ``copy_``);
- ``sync per pending tensor``: the step's execution materializes each pending
  tensor (here: an accumulated ``.grad``); a fused step materializes three per
  parameter (parameter, ``.grad``, momentum).

This measures each op's host time per tensor over ``--tensors`` tensors of
16 values (device idle at the start, best of ``--reps``), with torch_xla's
functionalization on (its default) and off (``XLA_DISABLE_FUNCTIONALIZATION=1``,
each in its own process: torch_xla reads it at import), then the host time
per parameter of ``openxla`` and ``openxla_fused_step`` on the parameter bank
``--workload`` (bench/models.py, loop ``set_to_none=False``, compiled SGD
momentum, alternated in one process), and the floor: the sum of the loop's
per-parameter ops, as a fraction of ``openxla``'s host time per parameter.

Last, what the fused step's cut costs per tensor as the step grows: for each
of ``--sizes``, the host time per tensor of embedding one computation with
that many inputs and outputs (as the fused step embeds its graphs) and of
the ``torch_xla.sync()`` that materializes its outputs.

    PJRT_DEVICE=CPU python -m bench.per_op [--tensors 1000] [--workload bank100] [--sizes 100,1000,3000] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

from bench import ROOT  # noqa: E402

FUNCTIONALIZATION_ENV = "XLA_DISABLE_FUNCTIONALIZATION"
# The loop's ops per parameter per step, and how many of each a fused step makes.
FLOOR = {"zero_": 1, "accumulate": 1, "param write-back": 1, "state write-back": 1, "sync per pending tensor": 3}
MODES = ("openxla", "openxla_fused_step")


def op_costs(n: int, reps: int) -> dict[str, float]:
    """Host microseconds per tensor of each op of :data:`FLOOR`, over ``n`` tensors."""
    dev = torch_xla.device()
    params = [torch.nn.Parameter(torch.full((16,), float(i), device=dev)) for i in range(n)]
    for p in params:
        p.grad = torch.zeros(16, device=dev)
    state = [torch.zeros(16, device=dev) for _ in range(n)]
    new = [torch.full((16,), 2.0 * i, device=dev) for i in range(n)]
    torch_xla.sync()

    def best(timed: Callable[[], Any], before: Callable[[], Any] = lambda: None) -> float:
        """Microseconds per tensor of ``timed()`` (best of ``reps``), each after ``before()``
        (untimed) and with the device idle; what they leave pending is synced after."""
        spent = []
        for _ in range(reps):
            with torch.no_grad():
                before()
                xm.wait_device_ops()
                t0 = time.perf_counter()
                timed()
                spent.append(time.perf_counter() - t0)
            torch_xla.sync()
        xm.wait_device_ops()
        return 1e6 * min(spent) / n

    def accumulate() -> None:
        for p, g in zip(params, new):
            p.grad.add_(g)

    costs = {
        "zero_": best(lambda: [p.grad.zero_() for p in params]),
        "accumulate": best(accumulate),
        "param write-back": best(lambda: [p.detach().copy_(g) for p, g in zip(params, new)]),
        "state write-back": best(lambda: [s.copy_(g) for s, g in zip(state, new)]),
    }
    best(torch_xla.sync, before=accumulate)  # compiles the sync's graph once, untimed
    costs["sync per pending tensor"] = best(torch_xla.sync, before=accumulate)
    return costs


def embedded_materializing(sizes: Iterable[int], reps: int) -> dict[str, dict[str, float]]:
    """Per size n: host microseconds per tensor of embedding an n-input, n-output computation, and of syncing its outputs.

    The computation is ``x * 0.5 + 1`` per input, lowered once and embedded
    per call as the fused step embeds its graphs; each call's outputs are the
    next call's inputs, as an optimizer step's are.
    """
    from torch_xla_bridge import _private

    found: dict[str, dict[str, float]] = {}
    for n in sizes:
        with torch.no_grad():
            holders = [_private.create_placeholder_tensor((16,), torch.float32) for _ in range(n)]
            ctx = _private.LoweringContext("PerOpScaling")
            # Traced on clones: the lowering maps each placeholder to its parameter by its untouched handle.
            ctx.build([h.clone() * 0.5 + 1 for h in holders])
            computation = _private.computation_from_module_proto("xla::per_op_scaling", ctx.hlo())
            order = {ctx.tensor_parameter_id(h): i for i, h in enumerate(holders)}
            constants = {pid: t for pid, t in ctx.device_parameter_id_tensor_mapping().items() if pid not in order}
            # Placeholders hold no data: none may be alive at the syncs below.
            del holders, ctx
        values = [torch.full((16,), float(i), device=torch_xla.device()) for i in range(n)]
        torch_xla.sync()
        embed, sync = [], []
        for r in range(reps + 1):
            xm.wait_device_ops()
            t0 = time.perf_counter()
            inputs = [values[order[k]] if k in order else constants[k] for k in range(len(order) + len(constants))]
            values = list(_private.user_computation("xla::per_op_scaling", inputs, computation))
            t1 = time.perf_counter()
            torch_xla.sync()
            t2 = time.perf_counter()
            if r:  # the first call compiles
                embed.append(t1 - t0)
                sync.append(t2 - t1)
        xm.wait_device_ops()
        found[str(n)] = {"embed": 1e6 * min(embed) / n, "sync": 1e6 * min(sync) / n}
    return found


def step_host_per_parameter(workload: str, rounds: int) -> dict[str, float]:
    """Median host microseconds per parameter tensor of one step (device idle at its start), per mode,
    the modes alternated in this process (bench.host_time's measurement, 3 steps per turn)."""
    from bench.host_time import measure_workload

    rows = measure_workload(workload, list(MODES), warmup=3, rounds=rounds, steps=3, block=1)["rows"]
    return {m: 1e3 * r["host_ms"] / r["tensors"] for m, r in rows.items()}


def measure(tensors: int, reps: int, workload: str, rounds: int, sizes: list[int]) -> dict[str, Any]:
    """This process's figures (functionalization as its environment says)."""
    costs = op_costs(tensors, reps)
    scaling = embedded_materializing(sizes, reps)
    step = step_host_per_parameter(workload, rounds)
    floor = sum(FLOOR[op] * us for op, us in costs.items())
    return dict(
        functionalization=os.environ.get(FUNCTIONALIZATION_ENV, "0") not in ("1", "true", "True"),
        op_us=costs, floor_us=floor, step_us=step, floor_ratio=floor / step["openxla"],
        fused_step_ratio=step["openxla_fused_step"] / step["openxla"], embedded_us=scaling,
    )


def markdown(report: dict) -> str:
    lines = [
        "# Per-parameter ops of a training loop: host cost and floor",
        "",
        f"{report['tensors']} tensors of 16 values; steps: {report['workload']}, loop set_to_none=False, "
        "compiled SGD momentum. Host microseconds per tensor (ops) and per parameter tensor (steps).",
        "",
        "| | per step | functionalization on | off |",
        "|---|---|---|---|",
    ]
    on, off = report["runs"]
    for op, count in FLOOR.items():
        lines.append(f"| {op} | {count} | {on['op_us'][op]:.2f} | {off['op_us'][op]:.2f} |")
    lines.append(f"| **floor** (sum) | | {on['floor_us']:.1f} | {off['floor_us']:.1f} |")
    for m in MODES:
        lines.append(f"| step, `{m}` | | {on['step_us'][m]:.1f} | {off['step_us'][m]:.1f} |")
    lines.append(f"| floor / `openxla` step | | {on['floor_ratio']:.2f} | {off['floor_ratio']:.2f} |")
    lines.append(f"| `openxla_fused_step` / `openxla` step | | {on['fused_step_ratio']:.2f} | "
                 f"{off['fused_step_ratio']:.2f} |")
    lines += [
        "",
        "Embedding one computation of n inputs and n outputs, and syncing its outputs "
        "(host microseconds per tensor, functionalization on / off):",
        "",
        "| n | embed | sync |",
        "|---|---|---|",
    ]
    for n in on["embedded_us"]:
        a, b = on["embedded_us"][n], off["embedded_us"][n]
        lines.append(f"| {n} | {a['embed']:.2f} / {b['embed']:.2f} | {a['sync']:.2f} / {b['sync']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workload", default="bank100")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--sizes", default="100,1000,3000", help="comma-separated sizes of the embedded computation")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # this process's JSON
    args = ap.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.one:
        print(json.dumps(measure(args.tensors, args.reps, args.workload, args.rounds, sizes)))
        return
    passed = ["--tensors", str(args.tensors), "--reps", str(args.reps), "--workload", args.workload,
              "--rounds", str(args.rounds), "--sizes", args.sizes]
    runs = []
    for off in ("0", "1"):
        env = dict(os.environ, **{FUNCTIONALIZATION_ENV: off})
        proc = subprocess.run([sys.executable, "-m", "bench.per_op", "--one", *passed], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"bench.per_op ({FUNCTIONALIZATION_ENV}={off}) failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    report = dict(tensors=args.tensors, workload=args.workload, floor_counts=FLOOR, runs=runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "per_op.json").write_text(json.dumps(report, indent=1))
    (args.out / "per_op.md").write_text(markdown(report))
    print((args.out / "per_op.md").read_text())


if __name__ == "__main__":
    main()
