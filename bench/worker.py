"""Runs one benchmark configuration in a fresh process and prints its figures as one JSON line.

A process per configuration keeps first-step compile time and peak RSS
(`ru_maxrss`) attributable to that configuration alone. A configuration with
`"modes": [...]` instead times those modes side by side (see `run_alternated`).

    python -m bench.worker '{"workload": "mlp8x128", "mode": "openxla_fused_grad", "loop": "zero_grads"}'
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable

os.environ.setdefault("PJRT_DEVICE", "CPU")
from bench import memory  # noqa: E402  (no torch_xla)

# Before torch_xla is imported (it reads the variables once), and only in a worker process, not when imported.
ANALYSIS_FILE = memory.enable() if __name__ == "__main__" else None

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

from bench.loops import LOOPS  # noqa: E402
from bench.models import by_name  # noqa: E402
from torch_xla_bridge.counting import executions  # noqa: E402
from torch_xla_bridge.names import BACKEND_NAME, BACKEND_NAMES, UPSTREAM_BACKEND_NAME  # noqa: E402

MODES = (UPSTREAM_BACKEND_NAME, *BACKEND_NAMES, "lazy", "torch_xla.compile")
DYNAMO_MODES = MODES[:3]


def _time_callbacks() -> list[float]:
    """Collects the seconds each end-of-backward callback (collect + sync) takes."""
    from torch_xla_bridge import grad_sync

    spent: list[float] = []
    original = grad_sync._BackwardPass.end_of_backward

    def timed(self: Any) -> None:
        t0 = time.perf_counter()
        original(self)
        spent.append(time.perf_counter() - t0)

    grad_sync._BackwardPass.end_of_backward = timed
    return spent


def build_step(cfg: dict) -> tuple[Callable[[], torch.Tensor], torch.nn.Module]:
    mode, loop = cfg["mode"], LOOPS[cfg["loop"]]
    set_to_none, compiled_opt = loop.set_to_none, loop.compiled_optimizer
    micro = cfg.get("micro", loop.micro)
    workload = by_name(cfg["workload"])
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = workload.make_model().to(dev)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(dev) for t in workload.make_batch(g)) for _ in range(micro)]

    def loss_of(*batch: torch.Tensor) -> torch.Tensor:
        return workload.loss(model, batch) / micro

    if mode in DYNAMO_MODES:
        fwd = torch.compile(loss_of, backend=mode)
        opt_step = torch.compile(opt.step, backend=mode) if compiled_opt else opt.step

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=set_to_none)
            for batch in batches:
                loss = fwd(*batch)
                loss.backward()
            opt_step()
            if not compiled_opt:
                torch_xla.sync()
            return loss

        return step, model

    def whole_step() -> torch.Tensor:
        opt.zero_grad(set_to_none=set_to_none)
        for batch in batches:
            loss = loss_of(*batch)
            loss.backward()
        opt.step()
        return loss

    if mode == "lazy":

        def step() -> torch.Tensor:
            loss = whole_step()
            torch_xla.sync()
            return loss

        return step, model
    if mode == "torch_xla.compile":
        return torch_xla.compile(whole_step), model
    raise ValueError(f"unknown mode {mode!r}")


def run(cfg: dict) -> dict:
    callbacks = _time_callbacks() if cfg["mode"] == BACKEND_NAME else []
    step, _ = build_step(cfg)
    steps, warmup = cfg.get("steps", 20), cfg.get("warmup", 3)
    host, total, execs, losses, callback_s = [], [], [], [], []
    for i in range(warmup + steps):
        xm.wait_device_ops()
        e0 = executions(wait=False)  # waited for just above
        n_callbacks = len(callbacks)
        t0 = time.perf_counter()
        loss = step()
        t1 = time.perf_counter()
        xm.wait_device_ops()
        t2 = time.perf_counter()
        if i == 0:
            compile_s = t2 - t0
        if i < 2:
            # Time to first step as a user feels it: the first two optimizer steps, each new
            # graph's compiles included (some graphs are new only at the second step).
            first_two_s = (first_two_s if i else 0.0) + (t2 - t0)
        if i >= warmup:
            host.append(t1 - t0)
            total.append(t2 - t0)
            execs.append(executions(wait=False) - e0)
            callback_s.append(sum(callbacks[n_callbacks:]))
            losses.append(loss.item())
    out = dict(
        cfg,
        executions_per_step=statistics.mode(execs),
        **_summary(total),
        host_ms=1e3 * statistics.median(host),
        compile_s=compile_s,
        first_two_s=first_two_s,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        final_loss=losses[-1],
    )
    if ANALYSIS_FILE is not None:
        out.update(memory.summary(memory.parse(ANALYSIS_FILE.read_text())))
        ANALYSIS_FILE.unlink(missing_ok=True)
    if callbacks:
        out["callback_ms"] = 1e3 * statistics.median(callback_s)
        out["callback_share"] = statistics.median(c / t for c, t in zip(callback_s, total, strict=True))
    return out


def _summary(seconds: list[float]) -> dict[str, float]:
    """Median and quartiles of step times, in ms."""
    q = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else [seconds[0]] * 3
    return dict(step_ms=1e3 * statistics.median(seconds), step_p25_ms=1e3 * q[0], step_p75_ms=1e3 * q[2])


def run_alternated(cfg: dict) -> dict:
    """Step time of several modes built side by side in one process, their blocks alternated.

    Separate processes differ by more than the backends do (memory layout,
    clocks); alternating blocks in one process exposes every mode to the same
    machine state, which is what the step-time ratios need.
    """
    steps = {m: build_step(dict(cfg, mode=m))[0] for m in cfg["modes"]}
    block, blocks = cfg.get("block", 5), cfg.get("blocks", 8)
    for step in steps.values():
        for _ in range(cfg.get("warmup", 3)):
            step()
    xm.wait_device_ops()
    times: dict[str, list[float]] = {m: [] for m in steps}
    for i in range(blocks):
        order = list(steps) if i % 2 == 0 else list(steps)[::-1]
        for m in order:
            for _ in range(block):
                t0 = time.perf_counter()
                steps[m]()
                xm.wait_device_ops()
                times[m].append(time.perf_counter() - t0)
    return dict(cfg, timing={m: _summary(t) for m, t in times.items()})


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    print(json.dumps(run_alternated(cfg) if "modes" in cfg else run(cfg)))
