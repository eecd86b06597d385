"""A Llama-shaped decoder on an SPMD mesh, per mesh and backend: examples/train_llama_spmd.py as the benchmark runs it.

    python -m bench.llama_spmd [--steps 6] [--json docs/benchmarks/spmd.json]

The example's training step (FSDPv2, optionally with tensor parallelism on a
2-D mesh; bf16 autocast; 4 micro-batches; HF's non-reentrant gradient
checkpointing; eager AdamW with a cosine schedule), with its default tiny
shapes, on 4 and 8 PJRT CPU devices (``CPU_NUM_DEVICES``: one process per device
count, and per mode, so that each mode's compiled programs are its own), under
``openxla``, both fused backends, and uncompiled lazy SPMD, the reference. Lazy
SPMD runs without checkpointing (the same math): uncompiled,
``torch.utils.checkpoint`` asks for a ``torch.xla`` device module that torch_xla
does not register.

Per run: XLA executions per optimizer step after the warm-up, what was compiled
after it (XLA programs and dynamo frames; both must stay flat), the largest
difference of its losses to lazy SPMD's, and the device memory of its largest
program per device, from XLA's own accounting (bench/memory.py: under SPMD each
compiled program is the per-device partition, so its sizes are per device).
``--json`` merges the rows into that file under ``"llama"``, keeping what
bench.spmd wrote there.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Sequence

from bench import ROOT, memory

MODES = ("lazy", "openxla", "openxla_fused_grad", "openxla_fused_step")
# (devices, --mesh): FSDPv2 alone, and 2-D with a "model" axis of 2: meshes (4, 1), (2, 2), (8, 1), (4, 2).
CONFIGS = ((4, "fsdp"), (4, "2d"), (8, "fsdp"), (8, "2d"))
WARMUP = 2  # steps that compile: the first step's programs, and AdamW's state made in it


def example() -> ModuleType:
    """examples/train_llama_spmd.py, loaded by path (it switches SPMD on when imported)."""
    spec = importlib.util.spec_from_file_location("train_llama_spmd", ROOT / "examples" / "train_llama_spmd.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dynamo imports a traced function's module by name to read its globals
    spec.loader.exec_module(module)
    return module


def worker(mesh: str, modes: Sequence[str], steps: int, path: str, extra: Sequence[str] = ()) -> None:
    """Runs ``modes`` in this process, one after another, and writes {mode: the example's summary + memory}.

    A mode's memory is read from the analysis of the programs compiled during its run; a program another
    mode compiled first would be a cache hit and missing from it, so the benchmark gives each mode a process.
    """
    analysis = memory.enable()  # before torch_xla is imported
    train = example()
    import torch

    out: dict[str, Any] = {}
    for mode in modes:
        torch._dynamo.reset()
        start = analysis.stat().st_size if analysis else 0
        argv = ["--backend", mode, "--mesh", mesh, "--steps", str(steps), *extra]
        out[mode] = train.main(argv + (["--no-checkpoint"] if mode == "lazy" else []))
        if analysis:
            with open(analysis) as f:
                f.seek(start)
                programs = memory.parse(f.read())
            out[mode].update(memory.summary(programs))
            if programs:  # its buffers by kind, in bytes
                out[mode]["largest_program"] = dataclasses.asdict(max(programs, key=lambda p: p.own_bytes))
    with open(path, "w") as f:
        json.dump(out, f)


def run_worker(devices: int, mesh: str, modes: Sequence[str], steps: int, tmp: Path) -> dict[str, Any]:
    """``worker`` in a fresh process with ``devices`` PJRT CPU devices."""
    path = tmp / f"llama-{devices}-{mesh}-{'-'.join(modes)}.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for var in ("PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_FILE"):  # memory.enable() makes its own
        env.pop(var, None)
    cmd = [sys.executable, "-m", "bench.llama_spmd", "--worker", "--mesh", mesh, "--modes", ",".join(modes),
           "--steps", str(steps), "--out", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} (CPU_NUM_DEVICES={devices}) failed:\n{proc.stderr[-4000:]}")
    return json.loads(path.read_text())


def row(devices: int, mesh: str, mode: str, run: dict[str, Any], lazy: dict[str, Any]) -> dict[str, Any]:
    """One table row: what a run did after its warm-up, and its losses against lazy SPMD's."""
    steady = run["executions"][WARMUP:]
    after, then = run["compiled"][-1], run["compiled"][WARMUP - 1]
    return dict(
        devices=devices, mesh=run["mesh"], mesh_kind=mesh, mode=mode, steps=len(run["losses"]),
        executions_per_step=statistics.mode(steady), executions_steady=steady, executions=run["executions"],
        compiled_after_warmup={k: after[k] - then[k] for k in after},
        max_loss_diff=max(abs(a - b) for a, b in zip(run["losses"], lazy["losses"], strict=True)),
        losses=run["losses"], median_step_ms=1000 * statistics.median(run["step_s"][WARMUP:]),
        device_peak_mb=run.get("device_peak_mb"), donated_mb=run.get("donated_mb"),
        programs_compiled=run.get("programs_compiled"), largest_program=run.get("largest_program"),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", help="merge the rows into this file (docs/benchmarks/spmd.json) under 'llama'")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mesh", default="fsdp", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=",".join(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args(argv)
    if args.worker:  # arguments it does not know go to the example (the tests: a smaller model)
        worker(args.mesh, args.modes.split(","), args.steps, args.out, extra)
        return 0

    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for devices, mesh in CONFIGS:
            runs = {mode: run_worker(devices, mesh, [mode], args.steps, Path(tmp))[mode] for mode in MODES}
            rows += [row(devices, mesh, mode, runs[mode], runs["lazy"]) for mode in MODES]
            settings = {k: v for k, v in runs["openxla_fused_step"]["args"].items() if k not in ("backend", "mesh", "json")}
            for r in rows[-len(MODES):]:
                print(f"{devices} devices, mesh {r['mesh']}, {r['mode']}: {r['executions_per_step']} executions/step, "
                      f"compiled after warm-up {r['compiled_after_warmup']}, max |loss - lazy| {r['max_loss_diff']:.2e}, "
                      f"largest program {r['device_peak_mb']} MB per device", flush=True)
    if args.json:
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.exists() else {}
        data["llama"] = dict(steps=args.steps, warmup=WARMUP, settings=settings, rows=rows)
        path.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
