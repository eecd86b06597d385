"""Time to first step of the scripts users start from: their first two optimizer steps, compiles included.

Each (script, mode) runs in a fresh process (compile caches start empty, as
at a restart), and the modes of one script run back to back; the ratio is to
upstream ``openxla`` for the same script. The scripts are this repository's
examples and the nanoGPT-shaped loop of the tests (no sync, eager AdamW,
2 micro-batches, clipping), each trained for 2 steps:

    python -m bench.first_step              # prints a markdown table
    python -m bench.first_step --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import time
from pathlib import Path

from bench import ROOT

MODES = ("openxla", "openxla_fused_grad", "openxla_fused_step")
SCRIPTS = ("nanogpt_shaped", "train_causal_lm", "train_resnet")


def _run_one(script: str, mode: str) -> dict:
    """In this process: the wall time of ``script``'s first two steps under ``mode``."""
    sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "test")]
    import importlib

    import torch_xla.core.xla_model as xm

    from torch_xla_bridge import counting

    if script == "nanogpt_shaped":
        import user_loops

        def run() -> None:
            user_loops.nanogpt_shaped(mode, steps=2)
    else:
        module = importlib.import_module(script)

        def run() -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                module.main(["--backend", mode, "--steps", "2"])

    t0 = time.perf_counter()
    run()
    xm.wait_device_ops()
    return {"script": script, "mode": mode, "first_two_s": time.perf_counter() - t0,
            "compiles": counting.counter("UncachedCompile")}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", nargs=2, metavar=("SCRIPT", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--scripts", default=",".join(SCRIPTS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(_run_one(*args.one)))
        return []
    rows = []
    for script in args.scripts.split(","):
        for mode in MODES:
            out = subprocess.run(
                [sys.executable, "-m", "bench.first_step", "--one", script, mode],
                cwd=ROOT, capture_output=True, text=True, check=True,
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    base = {r["script"]: r["first_two_s"] for r in rows if r["mode"] == MODES[0]}
    print("| script | mode | first 2 steps s | ratio | XLA compiles |\n|---|---|---|---|---|")
    for r in rows:
        r["ratio"] = r["first_two_s"] / base[r["script"]]
        print(f"| {r['script']} | {r['mode']} | {r['first_two_s']:.2f} | {r['ratio']:.2f} | {r['compiles']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
