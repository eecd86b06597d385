"""Host time and device time of one training step, per mode and workload.

Per workload, one trainer per mode is built first, each in a process of its
own (bench.worker's `build_step`, loop `zero_grads`: SGD with momentum, the
optimizer step compiled where the mode compiles), each is warmed up, then
rounds alternate the modes (the order reversed every other round). In its
turn a mode runs:

- `--steps` steps, each from an idle device (`xm.wait_device_ops()` before):
  **host time** is the step's Python call, `perf_counter` from call to return
  (the step includes its end: `torch_xla.sync()`, the fused step's cut), with
  no wait inside, and **host CPU**, the Python thread's own CPU time in that
  call (`time.thread_time`): on a machine whose cores also run PJRT CPU's
  executions, host time includes waiting for a core, host CPU does not; then, after `xm.wait_device_ops()`, **device time** is the
  step's delta of torch_xla's execute metrics (`ExecuteTime` total, ns;
  `ExecuteReplicatedTime` under SPMD) and **busy time** the union of those
  executions' intervals; the executions per step come from
  `counting.executions()`;
- one pipelined block of `--block` steps with no wait between steps, timed
  drained-to-drained, per step.

Each workload's trainers are coordinated by a process of its own (see `run_workload`).

Reported: medians (and quartiles of host time) per mode, ratios of medians to
upstream `openxla` measured in the same run, and a JAX `jax.jit` reference of
the MLP step run in a subprocess (`--jax-python`, or this interpreter when it
has jax). Writes host_time.json, host_time.md and host_time.png to `--out`.

    PJRT_DEVICE=CPU python -m bench.host_time [--quick] [--out DIR] [--jax-python PATH]
    PJRT_DEVICE=CPU python -m bench.host_time --profile openxla_fused_step --workload bank1000
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

from bench import ROOT  # noqa: E402
from bench.loops import LOOPS  # noqa: E402
from bench.worker import MODES, REPLAYED, TrainerProcess, build_step, replies_on_stdout  # noqa: E402
from torch_xla_bridge.counting import executions  # noqa: E402
from torch_xla_bridge.names import EXECUTE_METRICS, UPSTREAM_BACKEND_NAME  # noqa: E402

BASELINE = UPSTREAM_BACKEND_NAME
LOOP = "zero_grads"  # set_to_none=False, compiled optimizer (see bench/loops.py)
JAX_MODE = "jax.jit"
JAX_WORKLOAD = "mlp32x256"  # the workload bench/jax_step.py reproduces
WORKLOADS = ("mlp32x256", "gpt2-2L", "bank10", "bank100", "bank1000")
# Quick leaves out bank1000 as `python -m bench --quick` does: on 2 CPU cores its first
# steps compile for about 10 minutes across the five modes (dynamo and XLA alike).
QUICK_WORKLOADS = ("mlp32x256", "bank10", "bank100")
FULL = dict(warmup=3, rounds=10, steps=5, block=5)
QUICK = dict(warmup=3, rounds=4, steps=3, block=3)


def _execute_metrics() -> tuple[int, float, list[tuple[float, float]]]:
    """Executions so far, their total ExecuteTime (ns) and the recent (end s, duration ns) samples."""
    count, total, samples = 0, 0.0, []
    for name in EXECUTE_METRICS:
        data = met.metric_data(name)
        if data:
            count, total, samples = count + data[0], total + data[1], samples + list(data[2])
    return count, total, samples


def _busy_seconds(samples: list[tuple[float, float]]) -> float:
    """Length of the union of execution intervals [end - duration, end].

    An execution's ExecuteTime runs from its dispatch to its outputs being
    ready, so executions queued behind one another overlap: their sum counts
    the queueing twice, the union does not.
    """
    spans = sorted((end - ns / 1e9, end) for end, ns in samples)
    busy, cur_start, cur_end = 0.0, None, None
    for s, e in spans:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    return busy + (cur_end - cur_start if cur_end is not None else 0.0)


class Trainer:
    """One mode's training step on a workload of bench/models.py, with its measurements."""

    def __init__(self, mode: str, workload: str, loop: str = LOOP, spmd: bool = False) -> None:
        self.step, model = build_step(dict(workload=workload, mode=mode, loop=loop, spmd=spmd))
        self.tensors = len(list(model.parameters()))
        self.host: list[float] = []
        self.host_cpu: list[float] = []
        self.sync: list[float] = []
        self.device: list[float] = []
        self.busy: list[float] = []
        self.execs: list[int] = []
        self.pipelined: list[float] = []

    def timed_step(self) -> None:
        """One step from an idle device: host time, then (drained) device time and executions."""
        xm.wait_device_ops()
        e0 = executions(wait=False)  # waited for just above
        n0, d0, _ = _execute_metrics()
        t0, c0 = time.perf_counter(), time.thread_time()
        self.step()
        t1, c1 = time.perf_counter(), time.thread_time()
        xm.wait_device_ops()
        t2 = time.perf_counter()
        n1, d1, samples = _execute_metrics()
        self.host.append(t1 - t0)
        self.host_cpu.append(c1 - c0)
        self.sync.append(t2 - t0)
        self.device.append((d1 - d0) / 1e9)
        self.execs.append(executions(wait=False) - e0)
        # Samples are a bounded window of the latest; the step's are its last n1 - n0.
        if 0 < n1 - n0 <= len(samples):
            self.busy.append(_busy_seconds(sorted(samples)[-(n1 - n0):]))

    def pipelined_block(self, steps: int) -> None:
        """`steps` steps without waiting between them, drained to drained; per step."""
        xm.wait_device_ops()
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        xm.wait_device_ops()
        self.pipelined.append((time.perf_counter() - t0) / steps)

    def summary(self) -> dict[str, Any]:
        q = statistics.quantiles(self.host, n=4) if len(self.host) > 1 else [self.host[0]] * 3
        ms = lambda xs: round(1e3 * statistics.median(xs), 3) if xs else None  # noqa: E731
        return dict(
            tensors=self.tensors, executions_per_step=statistics.mode(self.execs), steps=len(self.host),
            host_ms=ms(self.host), host_p25_ms=round(1e3 * q[0], 3), host_p75_ms=round(1e3 * q[2], 3),
            host_cpu_ms=ms(self.host_cpu),
            device_ms=ms(self.device), busy_ms=ms(self.busy), sync_ms=ms(self.sync),
            pipelined_ms=ms(self.pipelined),
        )


def measure_workload(workload: str, modes: list[str], warmup: int, rounds: int, steps: int, block: int,
                     loop: str = LOOP, spmd: bool = False) -> dict:
    """Each mode's trainer in a process of its own (:func:`serve`, :class:`bench.worker.TrainerProcess`),
    their turns alternated round by round."""
    procs = {m: TrainerProcess(f"{m} on {workload}", "bench.host_time", "--serve", m, "--workload", workload,
                               "--loop", loop, *(["--spmd"] if spmd else [])) for m in modes}
    try:
        for m in modes:  # one at a time: compiles do not compete for the cores
            procs[m].ask(f"warmup {warmup}")
        for i in range(rounds):
            for m in modes if i % 2 == 0 else modes[::-1]:
                procs[m].ask(f"turn {steps} {block}")
        rows = {m: json.loads(procs[m].ask("summary")) for m in modes}
    finally:
        for proc in procs.values():
            proc.close()
    add_ratios(rows)
    return dict(workload=workload, loop=loop, rows=rows)


def serve(mode: str, workload: str, loop: str, spmd: bool = False) -> None:
    """One mode's trainer, run on command from stdin, one reply line per command on stdout.

    ``warmup N``: N steps, drained; ``turn STEPS BLOCK``: STEPS timed steps
    and one pipelined block; ``summary``: the trainer's figures as JSON.
    """
    out = replies_on_stdout()
    if spmd:
        xr.use_spmd()  # before the trainer touches a device
    trainer = Trainer(mode, workload, loop, spmd)
    for line in sys.stdin:
        command, *counts = line.split()
        n = [int(c) for c in counts]
        if command == "warmup":
            for _ in range(n[0]):
                trainer.step()
            xm.wait_device_ops()
            reply = "ok"
        elif command == "turn":
            for _ in range(n[0]):
                trainer.timed_step()
            trainer.pipelined_block(n[1])
            reply = "ok"
        else:
            reply = json.dumps(trainer.summary())
        out.write(reply + "\n")
        out.flush()


def run_workload(workload: str, modes: list[str], counts: dict[str, int], loop: str = LOOP,
                 spmd: bool = False) -> dict:
    """`measure_workload` in a fresh process: one row per mode, or an error row per mode.

    A process per workload: XLA keeps every executable it compiled for the
    process's life, and with all workloads' in one process PJRT CPU's JIT ran
    out of memory mappings (vm.max_map_count) while compiling bank1000's.
    """
    cmd = [sys.executable, "-m", "bench.host_time", "--one", workload, "--modes", ",".join(modes), "--loop", loop]
    cmd += [f"--{k}={v}" for k, v in counts.items()] + (["--spmd"] if spmd else [])
    env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
    if spmd:
        env.setdefault("CPU_NUM_DEVICES", "4")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    error = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return dict(workload=workload, loop=loop, rows={m: dict(error=error) for m in modes})


def add_ratios(rows: dict[str, dict]) -> None:
    """Ratios of medians to `openxla`'s in the same run (the JAX row's come from its own process)."""
    base = rows.get(BASELINE)
    if base is None:
        return
    for r in rows.values():
        for field in ("host_ms", "host_cpu_ms", "device_ms", "pipelined_ms"):
            if r.get(field) is not None and base.get(field):
                r[field.replace("_ms", "_ratio")] = round(r[field] / base[field], 3)


def jax_python(arg: str | None) -> str | None:
    """The interpreter to run bench/jax_step.py in: `--jax-python`, else this one if it has jax."""
    if arg:
        return arg
    return sys.executable if importlib.util.find_spec("jax") is not None else None


def _mlp_shape(workload: str) -> tuple[int, int, int] | None:
    """(depth, width, batch) of an MLP workload (bench/models.py), which bench/jax_step.py reproduces; else None."""
    from bench.models import by_name

    if not workload.startswith("mlp"):
        return None
    model = by_name(workload)
    linears = [m for m in model.make_model().modules() if isinstance(m, torch.nn.Linear)]
    batch = model.make_batch(torch.Generator().manual_seed(0))[0].shape[0]
    return len(linears) - 1, linears[0].out_features, batch


def run_jax(python: str, counts: dict[str, int], depth: int = 32, width: int = 256, batch: int = 64) -> dict:
    """The JAX reference step's figures for the MLP of that shape, or an "error" entry saying why there are none."""
    cfg = dict(depth=depth, width=width, batch=batch, **counts)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    try:
        proc = subprocess.run([python, str(ROOT / "bench" / "jax_step.py"), json.dumps(cfg)],
                              capture_output=True, text=True, timeout=600, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return dict(error=f"{python}: {e}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(error=(proc.stderr.strip().splitlines() or ["no output"])[-1])
    return json.loads(lines[-1])


def machine() -> dict[str, Any]:
    from bench.__main__ import machine as bench_machine

    return bench_machine()


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "—" if v is None else format(v, spec)


def markdown(report: dict) -> str:
    info = report["machine"]
    c = report["counts"]
    loop = report.get("loop", LOOP)
    lines = [
        f"# Host time and device time{' (quick)' if report['quick'] else ''}",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores; PJRT_DEVICE={info['pjrt_device']}; "
        f"torch {info['torch']}, torch_xla {info['torch_xla']}. Loop `{loop}` "
        f"({'' if LOOPS[loop].scheduled else 'SGD with momentum; '}{LOOPS[loop].label})"
        f"{'; SPMD, parameters sharded FSDP-style and batches over their rows' if report.get('spmd') else ''}. "
        f"{c['rounds']} rounds, modes alternated; per round "
        f"and mode {c['steps']} steps from an idle device and one pipelined block of {c['block']} steps.",
        "",
        "host: the step's Python call from an idle device until it returns (median, p25–p75); "
        "host CPU: the Python thread's CPU time in that call (without waits for a core the device's "
        "executions hold); "
        "device: sum of the step's `ExecuteTime` (dispatch to outputs ready, so executions queued behind "
        "one another count their wait too); busy: union of those intervals; sync: host + drain; "
        "pipelined: per step in blocks without waits, drained to drained. Ratios are to `openxla`, same run.",
    ]
    for w in report["workloads"]:
        rows = w["rows"]
        tensors = next((r["tensors"] for r in rows.values() if "tensors" in r), "?")
        lines += ["", f"## {w['workload']} ({tensors} parameter tensors)", "",
                  "| mode | execs/step | host ms (p25–p75) | host ratio | host CPU ms | host CPU ratio | device ms "
                  "| busy ms | sync ms | pipelined ms | pipelined ratio |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for m, r in rows.items():
            if "error" in r:
                lines.append(f"| {m} | {r['error'][:100]} |" + " |" * 9)
                continue
            spread = f" ({r['host_p25_ms']:.2f}–{r['host_p75_ms']:.2f})" if "host_p25_ms" in r else ""
            lines.append(
                f"| {m} | {r['executions_per_step']} | {r['host_ms']:.2f}{spread} | {_fmt(r.get('host_ratio'))} | "
                f"{_fmt(r.get('host_cpu_ms'), '.2f')} | {_fmt(r.get('host_cpu_ratio'))} | "
                f"{_fmt(r.get('device_ms'), '.2f')} | {_fmt(r.get('busy_ms'), '.2f')} | "
                f"{_fmt(r.get('sync_ms'), '.2f')} | {_fmt(r.get('pipelined_ms'), '.2f')} | "
                f"{_fmt(r.get('pipelined_ratio'))} |")
        if w["workload"] == JAX_WORKLOAD and JAX_MODE in rows:
            lines += ["", f"`{JAX_MODE}` (jax {rows[JAX_MODE].get('jax')}, CPU): the same MLP step (cross-entropy, "
                      "SGD momentum, parameters and momentum donated), run in its own process after the torch "
                      "modes; device and busy time are not measured (no metric); its ratios compare across "
                      "processes."]
    if report.get("jax_note"):
        lines += ["", f"JAX reference (`{JAX_MODE}` on {JAX_WORKLOAD}): {report['jax_note']}."]
    if report.get("plot_note"):
        lines += ["", f"Plot: {report['plot_note']}."]
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> str | None:
    """host_time.png: host ms per step against parameter tensors, one line per mode (banks), the MLP apart."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable (the [bench] extra); no plot"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    modes = list(dict.fromkeys(m for w in report["workloads"] for m in w["rows"]))
    for i, m in enumerate(modes):
        color = colors[i % len(colors)]
        # Banks: one line per mode. The MLP (big matmuls, not just many tensors): an open marker.
        bank = sorted((w["rows"][m]["tensors"], w["rows"][m]["host_ms"]) for w in report["workloads"]
                      if w["workload"].startswith("bank") and w["rows"].get(m, {}).get("host_ms") is not None)
        if bank:
            ax.plot([p[0] for p in bank], [p[1] for p in bank], marker="o", color=color, label=m)
        for w in report["workloads"]:
            r = w["rows"].get(m, {})
            if w["workload"] == JAX_WORKLOAD and r.get("host_ms") is not None:
                ax.plot([r["tensors"]], [r["host_ms"]], marker="s", markerfacecolor="none", color=color,
                        linestyle="none", label=None if bank else m)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"parameter tensors (lines: parameter banks; open squares: {JAX_WORKLOAD})")
    ax.set_ylabel("host ms per step (device idle at start)")
    ax.set_title("Host time of a training step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "host_time.png", dpi=120)
    plt.close(fig)
    return None


def profile(mode: str, workload: str, steps: int = 20, top: int = 25) -> None:
    """Prints the top cProfile entries (tottime) of `steps` warmed-up steps of one mode.

    cProfile sees the calling thread only: what runs inside `loss.backward()`
    on autograd's XLA device thread (backward graphs, hooks, the fused
    callbacks) shows as `run_backward`'s own time.
    """
    trainer = Trainer(mode, workload)
    for _ in range(3):
        trainer.step()
    xm.wait_device_ops()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        trainer.step()
    prof.disable()
    xm.wait_device_ops()
    print(f"{mode} on {workload}, {steps} steps (loop {LOOP}), top {top} by tottime:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"workloads {QUICK_WORKLOADS}, fewer rounds")
    ap.add_argument("--out", type=Path, default=None, help="default: docs/benchmarks (quick: docs/benchmarks/quick)")
    ap.add_argument("--workloads", help="comma-separated workloads of bench/models.py (overrides the plan)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {(*MODES, REPLAYED)}")
    for k in FULL:
        ap.add_argument(f"--{k}", type=int, help=f"default {FULL[k]} (quick: {QUICK[k]})")
    ap.add_argument("--jax-python", default=os.environ.get("BENCH_JAX_PYTHON"),
                    help="an interpreter with jax for the JAX reference (default: $BENCH_JAX_PYTHON, else this one "
                         "if it has jax)")
    ap.add_argument("--loop", default=LOOP, choices=list(LOOPS), help=f"a loop of bench/loops.py (default {LOOP})")
    ap.add_argument("--spmd", action="store_true",
                    help="under SPMD: parameters sharded FSDP-style over every device, batches over their rows "
                         "(PJRT CPU: CPU_NUM_DEVICES, default 4)")
    ap.add_argument("--one", metavar="WORKLOAD", help=argparse.SUPPRESS)  # one workload's JSON (run_workload)
    ap.add_argument("--profile", metavar="MODE", help="instead: cProfile 20 steps of MODE on --workload")
    ap.add_argument("--serve", metavar="MODE", help=argparse.SUPPRESS)  # one mode's trainer (serve)
    ap.add_argument("--workload", default="mlp32x256", help="the workload --profile runs")
    args = ap.parse_args(argv)
    if args.profile:
        profile(args.profile, args.workload)
        return
    if args.serve:
        serve(args.serve, args.workload, args.loop, args.spmd)
        return
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in (*MODES, REPLAYED)]:
        ap.error(f"unknown modes {unknown}; modes: {(*MODES, REPLAYED)}")
    counts = {k: getattr(args, k) or (QUICK if args.quick else FULL)[k] for k in FULL}
    workloads = args.workloads.split(",") if args.workloads else list(QUICK_WORKLOADS if args.quick else WORKLOADS)
    if args.one:
        print(json.dumps(measure_workload(args.one, modes, **counts, loop=args.loop, spmd=args.spmd)))
        return
    out = args.out or ROOT / "docs" / "benchmarks" / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    report: dict[str, Any] = dict(machine=machine(), quick=args.quick, counts=counts, loop=args.loop,
                                  spmd=args.spmd, workloads=[])
    for w in workloads:
        t0 = time.perf_counter()
        report["workloads"].append(run_workload(w, modes, counts, args.loop, args.spmd))
        print(f"{w}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        # Written as it goes: a later workload's crash keeps the earlier ones.
        (out / "host_time.json").write_text(json.dumps(report, indent=1))
    python = jax_python(args.jax_python)
    if python is None:
        report["jax_note"] = "jax not available"
    elif args.spmd:
        python, report["jax_note"] = None, "no jax.jit reference under SPMD"
    elif LOOPS[args.loop].scheduled:
        python, report["jax_note"] = None, "no jax.jit reference for this loop (the reference trains with SGD)"
    for w in report["workloads"]:
        shape = _mlp_shape(w["workload"])
        if python is None or shape is None:
            continue
        jax_row = run_jax(python, counts, *shape)
        if "error" in jax_row:
            report["jax_note"] = jax_row["error"]
        else:
            w["rows"][JAX_MODE] = jax_row
            add_ratios(w["rows"])
    report["plot_note"] = plot(report, out)
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "host_time.json").write_text(json.dumps(report, indent=1))
    (out / "host_time.md").write_text(markdown(report))
    print((out / "host_time.md").read_text())
    print(f"wrote {out}/host_time.json, host_time.md{'' if report['plot_note'] else ', host_time.png'} "
          f"in {report['seconds']:.0f} s")
    failed = [w["workload"] for w in report["workloads"] if any("error" in r for r in w["rows"].values())]
    if failed:
        print(f"FAILED workloads: {failed}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
