"""How the cost of a step grows with its micro-batches K: executions, compile time, memory, step time.

The loop people write for gradient accumulation: `zero_grad(set_to_none=False)`,
then per micro-batch `(loss / K).backward()`, then the optimizer step (SGD
with momentum, compiled with the backend where the mode compiles), on a
GPT-2-shaped model (4 layers, width 256, sequence 128, batch 4 per
micro-batch). Each (K, mode) runs in a process of its own (`bench.worker`),
and reports:

- executions per optimizer step;
- XLA compile seconds (torch_xla's `CompileTime`, every program the run compiled) and the first two steps'
  wall time (time to first step, compiles included);
- device memory: the largest compiled program's own buffers (`device_peak_mb`, XLA's memory analysis, as
  `bench.memory` reads it) and the state resident between steps (`resident_mb`: parameters, gradients,
  optimizer state), each on its own: a program's arguments include some of that state, so the two do not add;
- the steady step's median wall time.

Modes: upstream `openxla`, the two fused backends, LazyTensor (one `torch_xla.sync()` per optimizer step), and
torch_xla's own While-loop `gradient_accumulation` (the loop rewritten around a pure `train_step`, with the
micro-batches stacked first). Writes accumulation.json and accumulation.md to `--out`.

    PJRT_DEVICE=CPU python -m bench.accumulation                 # K 1, 4, 16, 64 (LazyTensor to K=16: hours beyond)
    PJRT_DEVICE=CPU python -m bench.accumulation --quick         # mlp8x128, K 1, 2, 4: about 2 minutes
    PJRT_DEVICE=CPU python -m bench.accumulation --ks 1,4 --modes openxla_fused_step
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable

from bench import ROOT, run_config

WORKLOAD = "gpt2-4L-d256-s128-b4"
QUICK_WORKLOAD = "mlp8x128"
KS = (1, 4, 16, 64)
QUICK_KS = (1, 2, 4)
MODES = ("openxla", "openxla_fused_grad", "openxla_fused_step", "lazy", "gradient_accumulation")
# Modes whose step's program holds every micro-batch (LazyTensor traces the K micro-batches into one graph).
UNROLLED = ("lazy",)
COLUMNS = (
    ("executions_per_step", "executions/step", "{}"),
    ("xla_compile_s", "XLA compile s", "{:.1f}"),
    ("first_two_s", "first two steps s", "{:.1f}"),
    ("device_peak_mb", "largest program MB", "{:.1f}"),
    ("resident_mb", "resident state MB", "{:.1f}"),
    ("step_ms", "step ms", "{:.1f}"),
)


def run_one(workload: str, mode: str, k: int, steps: int, warmup: int) -> dict[str, Any]:
    """One (K, mode) in its own process; its row, or the error it stopped with."""
    cfg = dict(workload=workload, loop="accumulate4", micro=k, mode=mode, steps=steps, warmup=warmup)
    return run_config(cfg, timeout=7200)


def markdown(rows: list[dict[str, Any]], workload: str) -> str:
    head = "| K | mode | " + " | ".join(label for _, label, _ in COLUMNS) + " |"
    lines = [f"# Gradient accumulation: cost against micro-batches ({workload})", "", head,
             "|---|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['micro']} | {r['mode']} | failed: {r['error'][:80]} |")
            continue
        if "skipped" in r:
            lines.append(f"| {r['micro']} | {r['mode']} | not run: {r['skipped']} |")
            continue
        cells = [fmt.format(r[key]) if r.get(key) is not None else "-" for key, _, fmt in COLUMNS]
        lines.append(f"| {r['micro']} | {r['mode']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_WORKLOAD}, K {QUICK_KS}")
    ap.add_argument("--ks", help="comma-separated micro-batch counts")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workload")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-unrolled-k", type=int, default=16,
                    help="largest K run for the modes that unroll every micro-batch into one program (hours beyond)")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/benchmarks (quick: docs/benchmarks/quick)")
    args = ap.parse_args(argv)
    workload = args.workload or (QUICK_WORKLOAD if args.quick else WORKLOAD)
    ks = [int(k) for k in args.ks.split(",")] if args.ks else list(QUICK_KS if args.quick else KS)
    out = args.out or ROOT / "docs" / "benchmarks" / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in ks:
        for mode in args.modes.split(","):
            if mode in UNROLLED and k > args.max_unrolled_k:
                rows.append(dict(micro=k, mode=mode, skipped=f"unrolled: K > {args.max_unrolled_k} (--max-unrolled-k)"))
                continue
            r = run_one(workload, mode, k, args.steps, args.warmup)
            rows.append(r)
            print(markdown([r], workload).splitlines()[-1], flush=True)
    (out / "accumulation.json").write_text(json.dumps(dict(workload=workload, rows=rows), indent=1))
    (out / "accumulation.md").write_text(markdown(rows, workload))
    failed = [r for r in rows if "error" in r]
    print(f"wrote {out}/accumulation.json, accumulation.md; {len(rows)} configurations, {len(failed)} failed")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
