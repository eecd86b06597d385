"""Benchmarks `openxla_fused_grad` and `openxla_fused_step` against upstream `openxla`, LazyTensor and `torch_xla.compile`.

Every configuration (workload x loop x mode) runs in its own process (see
`bench/worker.py`); the figures land in `--out` as results.json, results.md,
steps.png and scaling.png, with ratios to upstream `openxla` for the same
workload and loop. Then `bench.phases --check` (with and without SPMD: the fused steps run
while Python goes on) and `bench.host_time` (host and device time of a step,
each mode in a process of its own, turns alternated) run, the latter with the
same `--quick` and `--out`; `--no-host-time` leaves it out. The run fails on
a configuration that failed, on a fused backend's executions per step other
than it guarantees (:func:`execution_regressions`), and on a failed check.

    python -m bench            # the full run (about 34 minutes on 2 CPU cores, plus 9 for bench.host_time)
    python -m bench --quick    # about 3.5 minutes, plus 2 for bench.host_time --quick
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from tqdm import tqdm

from bench import ROOT, run_config
from bench.loops import LOOPS, traced_equivalent
from bench.worker import DYNAMO_MODES, MODES
from torch_xla_bridge.names import BACKEND_NAME, STEP_BACKEND_NAME, UPSTREAM_BACKEND_NAME


def plan(quick: bool) -> list[dict]:
    steps = dict(steps=6, warmup=2) if quick else dict(steps=20, warmup=3)
    mlp = "mlp8x128" if quick else "mlp32x256"
    configs = []
    for w in (mlp, "resnet18", "gpt2-2L"):
        # Quick: both optimizer paths on the MLP, the main loop elsewhere (under 5 minutes).
        loops = (["zero_grads", "eager_optimizer"] if w == mlp else ["zero_grads"]) if quick else [
            name for name, lp in LOOPS.items() if not lp.scheduled]
        for loop in loops:
            # LazyTensor and torch_xla.compile have no eager-optimizer
            # variant: their optimizer is always traced with the step.
            modes = MODES if LOOPS[loop].compiled_optimizer else DYNAMO_MODES
            configs += [dict(workload=w, loop=loop, mode=m, study="main", **steps) for m in modes]
    for n in (10, 100) if quick else (10, 100, 1000):
        configs += [dict(workload=f"bank{n}", loop="zero_grads", mode=m, study="parameters", **steps)
                    for m in DYNAMO_MODES]
    for micro in (1, 4) if quick else (1, 4, 16):
        configs += [dict(workload=mlp, loop="accumulate4", micro=micro, mode=m, study="micro_batches", **steps)
                    for m in DYNAMO_MODES]
    if quick:
        # Quick keeps each configuration's own (isolated) step time: no timing processes.
        return configs
    # Step time: each (workload, loop, micro) group's modes alternated, each in a process of its own.
    groups: dict[tuple, list[str]] = {}
    for c in configs:
        groups.setdefault((c["study"], c["workload"], c["loop"], c.get("micro")), []).append(c["mode"])
    for (study, workload, loop, micro), modes in groups.items():
        timing = dict(study=study, workload=workload, loop=loop, modes=modes, warmup=3, blocks=8, block=5)
        if micro is not None:
            timing["micro"] = micro
        configs.append(timing)
    return configs


def merge_timings(results: list[dict]) -> list[dict]:
    """Replaces each configuration's own step time by the alternated one of its group."""
    timings = {_key(r): r for r in results if "modes" in r}
    rows = [r for r in results if "modes" not in r]
    if not timings:  # --quick
        return rows
    for r in rows:
        t = timings.get(_key(r))
        if "error" in r:
            continue
        if t is None or "error" in t:
            r["error"] = "step timing failed: " + (t or {}).get("error", "missing")
            continue
        r["isolated_step_ms"] = r["step_ms"]
        r.update(t["timing"][r["mode"]])
    return rows


def run_all(configs: list[dict]) -> list[dict]:
    return [run_config(cfg, timeout=1800) for cfg in tqdm(configs, desc="bench", unit="config")]


def _key(r: dict) -> tuple:
    return (r["study"], r["workload"], r["loop"], r.get("micro"))


def add_ratios(results: list[dict]) -> None:
    """Ratios to upstream `openxla` on the same workload and loop, and step time and RSS to LazyTensor.

    LazyTensor's optimizer is always traced with its step, so its row of the
    loop's traced equivalent (`zero_grads` for `eager_optimizer`) is the
    reference for an eager-optimizer loop too.
    """
    base = {_key(r): r for r in results if r["mode"] == UPSTREAM_BACKEND_NAME and "error" not in r}
    lazy = {_key(r): r for r in results if r["mode"] == "lazy" and "error" not in r}
    for r in results:
        if "error" in r:
            continue
        b = base.get(_key(r))
        if b is not None:
            for field in ("step_ms", "host_ms", "compile_s", "first_two_s", "peak_rss_mb", "device_peak_mb"):
                if r.get(field) is not None and b.get(field):
                    r[f"{field}_ratio"] = r[field] / b[field]
        study, workload, loop, micro = _key(r)
        lz = lazy.get(_key(r)) or lazy.get((study, workload, traced_equivalent(loop), micro))
        if lz is not None and r["mode"] != "lazy":
            for field in ("step_ms", "peak_rss_mb"):
                r[f"{field}_ratio_lazy"] = r[field] / lz[field]


def machine() -> dict[str, Any]:
    import torch
    import torch_xla

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return dict(
        cpu=cpu, cores=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
        torch_xla=torch_xla.__version__, pjrt_device=os.environ.get("PJRT_DEVICE", "CPU"),
        memory_gb=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    )


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "—" if v is None else format(v, spec)


def markdown(results: list[dict], info: dict, quick: bool) -> str:
    lines = [
        f"# Benchmarks{' (quick)' if quick else ''}",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gb']} GiB; PJRT_DEVICE={info['pjrt_device']}; "
        f"torch {info['torch']}, torch_xla {info['torch_xla']}, Python {info['python']}.",
        "",
        "Each row is one process: executions, host time, first-step compile time, the first two steps' wall "
        "time (time to first step, compiles included) and peak RSS are that "
        "configuration's alone. Step time: median (p25–p75) of synchronous steps after warm-up, "
        + ("measured in each configuration's own process (quick mode)." if quick else
           "measured with each mode of a row group in a process of its own and their blocks of steps "
           "alternated, so that they share the machine's state.")
        + " Host: Python time until the step's last dispatch. Ratios are to upstream `openxla` on the "
        "same workload and loop; \"vs lazy\" to LazyTensor (`torch_xla.sync()` per step, its optimizer "
        "traced with the step) on the same workload. Device peak: the largest compiled program's own buffers "
        "(arguments + outputs - donated + temporaries, from XLA's compile-time accounting; see bench/memory.py: "
        "a lower bound for modes with several programs per step), and the bytes it donates.",
        "",
        "| workload | loop | mode | execs/step | step ms (p25–p75) | ratio | vs lazy | host ms | ratio | compile s "
        "| ratio | first 2 steps s | ratio | peak RSS MB | ratio | vs lazy | device peak MB | ratio | donated MB "
        "| final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        loop = r["loop"] + (f" x{r['micro']}" if r.get("micro") else "")
        if "error" in r:
            lines.append(f"| {r['workload']} | {loop} | {r['mode']} | error: {r['error'][:80]} |" + " |" * 16)
            continue
        lines.append(
            f"| {r['workload']} | {loop} | {r['mode']} | {r['executions_per_step']} | "
            f"{r['step_ms']:.2f} ({r['step_p25_ms']:.2f}–{r['step_p75_ms']:.2f}) | {_fmt(r.get('step_ms_ratio'), '.3f')} | "
            f"{_fmt(r.get('step_ms_ratio_lazy'), '.3f')} | "
            f"{r['host_ms']:.2f} | {_fmt(r.get('host_ms_ratio'), '.3f')} | {r['compile_s']:.2f} | "
            f"{_fmt(r.get('compile_s_ratio'), '.3f')} | {r['first_two_s']:.2f} | {_fmt(r.get('first_two_s_ratio'), '.3f')} | "
            f"{r['peak_rss_mb']:.0f} | {_fmt(r.get('peak_rss_mb_ratio'), '.3f')} | "
            f"{_fmt(r.get('peak_rss_mb_ratio_lazy'), '.3f')} | {_fmt(r.get('device_peak_mb'), '.2f')} | "
            f"{_fmt(r.get('device_peak_mb_ratio'), '.3f')} | {_fmt(r.get('donated_mb'), '.2f')} | {r['final_loss']:.5f} |"
        )
    fused = [r for r in results if r["mode"] == BACKEND_NAME and "callback_share" in r]
    if fused:
        lines += ["", "End-of-backward callback (collect + one sync) of `openxla_fused_grad`:", "",
                  "| workload | loop | callback ms | share of step time |", "|---|---|---|---|"]
        for r in fused:
            loop = r["loop"] + (f" x{r['micro']}" if r.get("micro") else "")
            lines.append(f"| {r['workload']} | {loop} | {r['callback_ms']:.3f} | {100 * r['callback_share']:.2f}% |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [r for r in results if r["study"] == "main" and "error" not in r]
    groups = sorted({(r["workload"], r["loop"]) for r in main}, key=lambda g: [x for x in g])
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 4.5))
    width = 0.8 / len(MODES)
    for i, mode in enumerate(MODES):
        xs, ys = [], []
        for j, g in enumerate(groups):
            r = next((r for r in main if (r["workload"], r["loop"]) == g and r["mode"] == mode), None)
            if r is not None:
                xs.append(j + i * width)
                ys.append(r["step_ms"])
        ax.bar(xs, ys, width, label=mode)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{w}\n{loop}" for w, loop in groups], fontsize=7)
    ax.set_ylabel("median step time (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Step time by workload, loop and mode")
    fig.tight_layout()
    fig.savefig(out / "steps.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, study, xfield, xlabel in (
        (axes[0], "parameters", lambda r: int(r["workload"][4:]), "parameter tensors"),
        (axes[1], "micro_batches", lambda r: r["micro"], "micro-batches per step"),
    ):
        for mode in DYNAMO_MODES:
            rows = sorted((r for r in results if r["study"] == study and r["mode"] == mode and "error" not in r),
                          key=xfield)
            ax.plot([xfield(r) for r in rows], [r["host_ms"] for r in rows], marker="o", label=f"{mode} host")
            if mode == BACKEND_NAME:
                ax.plot([xfield(r) for r in rows], [r["callback_ms"] for r in rows], marker="x", linestyle="--",
                        label="fused: callback + sync")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=8)
    fig.suptitle("Per-step host overhead as the step grows")
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)
    plt.close(fig)


def run_host_time(quick: bool, out: Path) -> str | None:
    """Runs `bench.host_time` in its own process (its modes share one); None, or why it failed."""
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    cmd = [sys.executable, "-m", "bench.host_time", "--out", str(out)] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["no output"])[-1]
    print((proc.stdout.strip().splitlines() or ["bench.host_time: no output"])[-1])
    return None


# Dynamo graphs per forward where the model has a graph break (HF GPT-2: one per step in each direction).
FORWARD_GRAPHS = {"gpt2": 2}


def execution_regressions(results: list[dict]) -> list[str]:
    """The fused backends' executions per step that differ from what they guarantee: one for
    ``openxla_fused_step``; for ``openxla_fused_grad`` a forward and a backward per graph and
    micro-batch, then the optimizer's."""
    wrong = []
    for r in results:
        if "error" in r or r["mode"] not in (STEP_BACKEND_NAME, BACKEND_NAME):
            continue
        micro = r.get("micro", LOOPS[r["loop"]].micro)
        graphs = FORWARD_GRAPHS.get(r["workload"].split("-")[0], 1)
        want = 1 if r["mode"] == STEP_BACKEND_NAME else 2 * graphs * micro + 1
        if r["executions_per_step"] != want:
            wrong.append(f"{r['workload']} {r['loop']} x{micro} {r['mode']}: {r['executions_per_step']} "
                         f"executions per step, expected {want}")
    return wrong


def run_phase_checks() -> list[str]:
    """`bench.phases --check`, then with `--spmd`, each in its own process: the steps that must run
    while Python goes on; why each failed (empty: none did)."""
    failed = []
    for extra in ([], ["--spmd"]):
        env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
        proc = subprocess.run([sys.executable, "-m", "bench.phases", "--check", *extra], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=1200)
        print(proc.stdout.strip())
        if proc.returncode != 0:
            failed += [line for line in proc.stderr.splitlines() if line.startswith("FAILED")] or \
                [f"bench.phases --check {' '.join(extra)}: exit {proc.returncode}: "
                 + (proc.stderr.strip().splitlines() or ["no output"])[-1]]
    return failed


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small workloads, fewer loops (under 5 minutes)")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/benchmarks (quick: docs/benchmarks/quick)")
    ap.add_argument("--no-host-time", action="store_true", help="skip bench.host_time")
    args = ap.parse_args(argv)
    out = args.out or ROOT / "docs" / "benchmarks" / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    results = merge_timings(run_all(plan(args.quick)))
    add_ratios(results)
    info = machine()
    (out / "results.json").write_text(json.dumps(dict(machine=info, quick=args.quick, results=results), indent=1))
    (out / "results.md").write_text(markdown(results, info, args.quick))
    plot(results, out)
    errors = [r for r in results if "error" in r]
    print(f"wrote {out}/results.json, results.md, steps.png, scaling.png; {len(results)} configurations, "
          f"{len(errors)} failed")
    regressions = execution_regressions(results) + run_phase_checks()
    host_time_error = None if args.no_host_time else run_host_time(args.quick, out)
    if errors or host_time_error or regressions:
        for r in errors:
            print("FAILED", r["workload"], r["loop"], r["mode"], r["error"], file=sys.stderr)
        for why in regressions:
            print("FAILED", why, file=sys.stderr)
        if host_time_error:
            print("FAILED bench.host_time:", host_time_error, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
