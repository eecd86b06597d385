"""karpathy/nanoGPT's `train.py`, unmodified, at several `gradient_accumulation_steps`: compile time and memory.

The script runs as its author wrote it (no sync added; its own eager AdamW, clipping and
`loss.item()` logging), with one change outside it: `torch.compile`'s backend, which
`train.py` does not let you choose, is set by a wrapper before the script starts
(`--backends`; `none` keeps torch.compile off and trains LazyTensor). The data is a
synthetic character dataset written beside a copy of the checkout (no download), the
model a GPT-2 shape (4 layers, width 256, block 128, batch 4 per micro-batch, float32).
Each (backend, K) runs in a process of its own and reports the XLA compile seconds
(torch_xla's `CompileTime`, every program of the run), the largest compiled program's own
buffers (`bench.memory`), executions, and the last iteration's loss and time as
`train.py` prints them.

nanoGPT is not in this repository: clone it first (the benchmark needs no network itself).

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT
    PJRT_DEVICE=CPU python -m bench.nanogpt --nanogpt /tmp/nanoGPT               # K 1, 16, 64
    PJRT_DEVICE=CPU python -m bench.nanogpt --nanogpt /tmp/nanoGPT --ks 1,4 --backends openxla
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench import ROOT

VOCAB = 65
TRAIN_ARGS = (
    "--dataset=synth --device=xla --dtype=float32 --n_layer=4 --n_head=4 --n_embd=256 --block_size=128"
    " --batch_size=4 --dropout=0.0 --eval_iters=1 --eval_interval=1000 --log_interval=1 --wandb_log=False"
).split()

# Runs train.py as __main__ with torch.compile's backend chosen, then prints one RESULT line.
_WRAPPER = """
import atexit, functools, runpy, sys
sys.path.insert(0, {root!r})
from bench import memory
analysis = memory.enable()
import torch, torch_xla.debug.metrics as met, torch_xla.core.xla_model as xm
backend = {backend!r}
if backend == "none":
    sys.argv += ["--compile=False"]
else:
    torch.compile = functools.partial(torch.compile, backend=backend)
def report():
    xm.wait_device_ops()
    compile_s = (met.metric_data("CompileTime") or (0, 0))[1] / 1e9
    peak = memory.summary(memory.parse(analysis.read_text()))["device_peak_mb"]
    print(f"RESULT compile_s={{compile_s:.1f}} peak_mb={{peak:.1f}} executions={{met.metric_data('ExecuteTime')[0]}}")
atexit.register(report)
runpy.run_path("train.py", run_name="__main__")
"""


def prepare(nanogpt: Path, into: Path) -> None:
    """Copies the three files `train.py` needs and writes a synthetic dataset (uint16 tokens, as nanoGPT's)."""
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(nanogpt / name, into / name)
    data = into / "data" / "synth"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 200_000), ("val", 20_000)):
        rng.integers(0, VOCAB, n).astype(np.uint16).tofile(data / f"{split}.bin")
    import pickle

    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": VOCAB}))


def run(workdir: Path, backend: str, k: int, iters: int) -> dict[str, str]:
    """One training run in a fresh process: RESULT's fields, plus the last iteration's loss and time."""
    argv = [sys.executable, "-c", _WRAPPER.format(root=str(ROOT), backend=backend), *TRAIN_ARGS,
            f"--gradient_accumulation_steps={k}", f"--max_iters={iters}", f"--out_dir={workdir / 'out'}"]
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
    result = re.search(r"RESULT (.*)", proc.stdout)
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"{backend} K={k} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    fields = dict(kv.split("=") for kv in result[1].split())
    last = re.findall(r"iter \d+: loss ([0-9.]+), time ([0-9.]+)ms", proc.stdout)[-1]
    fields.update(loss=last[0], iter_ms=last[1])
    return fields


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nanogpt", type=Path, required=True, help="a karpathy/nanoGPT checkout")
    ap.add_argument("--ks", default="1,16,64", help="gradient_accumulation_steps values")
    ap.add_argument("--backends", default="openxla_fused_step,openxla")
    ap.add_argument("--iters", type=int, default=3, help="optimizer steps after the first")
    args = ap.parse_args(argv)
    print("| backend | K | XLA compile s | largest program MB | executions | last iter loss | last iter ms |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="nanogpt-") as tmp:
        prepare(args.nanogpt, Path(tmp))
        for backend in args.backends.split(","):
            for k in (int(k) for k in args.ks.split(",")):
                r = run(Path(tmp), backend, k, args.iters)
                print(f"| `{backend}` | {k} | {r['compile_s']} | {r['peak_mb']} | {r['executions']} | {r['loss']} | {r['iter_ms']} |",
                      flush=True)


if __name__ == "__main__":
    main()
