"""Runs one benchmark configuration in a fresh process and prints its figures as one JSON line.

A process per configuration keeps first-step compile time and peak RSS
(`ru_maxrss`) attributable to that configuration alone. A configuration with
`"modes": [...]` instead times those modes, each in a process of its own, their blocks alternated
(see `run_alternated`).

    python -m bench.worker '{"workload": "mlp8x128", "mode": "openxla_fused_grad", "loop": "zero_grads"}'
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, TextIO

os.environ.setdefault("PJRT_DEVICE", "CPU")
from bench import ROOT, memory  # noqa: E402  (no torch_xla)


# Before torch_xla is imported (it reads the variables once), and only in a worker process, not when imported.
ANALYSIS_FILE = memory.enable() if __name__ == "__main__" else None

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402

from bench.loops import LOOPS  # noqa: E402
from bench.models import by_name  # noqa: E402
from torch_xla_bridge.counting import executions  # noqa: E402
from torch_xla_bridge.names import BACKEND_NAME, BACKEND_NAMES, STEP_BACKEND_NAME, UPSTREAM_BACKEND_NAME  # noqa: E402

MODES = (UPSTREAM_BACKEND_NAME, *BACKEND_NAMES, "lazy", "torch_xla.compile")
# torch_xla's own While-loop accumulation (torch_xla.experimental.gradient_accumulation): bench.accumulation only.
GRADIENT_ACCUMULATION = "gradient_accumulation"
DYNAMO_MODES = MODES[:3]
# openxla_fused_step's step handed over whole (@torch_xla_bridge.replayed_step): bench.host_time only.
REPLAYED = "openxla_fused_step+replayed_step"


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
    step, model, _ = build_trainer(cfg)
    return step, model


def build_trainer(cfg: dict) -> tuple[Callable[[], torch.Tensor], torch.nn.Module, torch.optim.Optimizer]:
    """One configuration's training step, its model and its optimizer (SGD with momentum; for a scheduled
    loop AdamW with a tensor lr, and the step sets the next lr after it, as a scheduler does)."""
    step, model, opt = _build_trainer(cfg)
    if not LOOPS[cfg["loop"]].scheduled:
        return step, model, opt
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))

    def scheduled() -> torch.Tensor:
        loss = step()
        scheduler.step()
        return loss

    return scheduled, model, opt


def _build_trainer(cfg: dict) -> tuple[Callable[[], torch.Tensor], torch.nn.Module, torch.optim.Optimizer]:
    mode, loop = cfg["mode"], LOOPS[cfg["loop"]]
    set_to_none, compiled_opt = loop.set_to_none, loop.compiled_optimizer
    micro = cfg.get("micro", loop.micro)
    workload = by_name(cfg["workload"])
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = workload.make_model().to(dev)
    model.train()
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), capturable=True) if loop.scheduled else
        torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))
    g = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(dev) for t in workload.make_batch(g)) for _ in range(micro)]
    if cfg.get("spmd"):
        _shard(model, batches)

    def loss_of(*batch: torch.Tensor) -> torch.Tensor:
        return workload.loss(model, batch) / micro

    if mode == REPLAYED:
        import torch_xla_bridge

        fwd = torch.compile(loss_of, backend=STEP_BACKEND_NAME)
        opt_step = torch.compile(opt.step, backend=STEP_BACKEND_NAME) if compiled_opt else opt.step

        # The batches are its arguments: a tensor it read from outside would keep it traced.
        @torch_xla_bridge.replayed_step
        def whole(*flat: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=set_to_none)
            for i in range(0, len(flat), len(batches[0])):
                loss = fwd(*flat[i:i + len(batches[0])])
                loss.backward()
            opt_step()
            return loss

        flat = [t for batch in batches for t in batch]
        return (lambda: whole(*flat)), model, opt
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

        return step, model, opt

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

        return step, model, opt
    if mode == "torch_xla.compile":
        return torch_xla.compile(whole_step), model, opt
    if mode == GRADIENT_ACCUMULATION:
        from torch_xla.experimental.gradient_accumulation import gradient_accumulation

        # Its loop runs over the leading dimension of stacked micro-batches, materialized first.
        stacked = [torch.stack([b[k] for b in batches]) for k in range(len(batches[0]))]
        torch_xla.sync()

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=set_to_none)
            loss = gradient_accumulation(loss_of, stacked, model)  # the micro-batches' summed losses
            opt.step()
            torch_xla.sync()
            return loss

        return step, model, opt
    raise ValueError(f"unknown mode {mode!r}")


def _shard(model: torch.nn.Module, batches: list[tuple[torch.Tensor, ...]]) -> None:
    """Under SPMD, FSDP-style on a 1-D mesh of every device: each parameter split along its largest dimension
    the devices divide (replicated if none does), each batch tensor along its first."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    for p in model.parameters():
        dims = [d for d in range(p.dim()) if p.shape[d] % n == 0]
        if dims:
            spec: list[Any] = [None] * p.dim()
            spec[max(dims, key=lambda d: p.shape[d])] = "data"
            xs.mark_sharding(p, mesh, tuple(spec))
    for t in (t for batch in batches for t in batch):
        if t.dim() and t.shape[0] % n == 0:
            xs.mark_sharding(t, mesh, ("data",) + (None,) * (t.dim() - 1))


def resident_mb(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """MB of the state that stays on the device between steps: parameters, gradients, optimizer state."""
    tensors = {id(t): t for p in model.parameters() for t in (p, p.grad) if t is not None}
    tensors.update({id(t): t for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.device.type == "xla"})
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20


def run(cfg: dict) -> dict:
    callbacks = _time_callbacks() if cfg["mode"] == BACKEND_NAME else []
    step, model, opt = build_trainer(cfg)
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
        xla_compile_s=(met.metric_data("CompileTime") or (0, 0.0))[1] / 1e9,
        resident_mb=resident_mb(model, opt),
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


class TrainerProcess:
    """A trainer in a process of its own (``python -m MODULE ARGS...``), run by commands on its stdin.

    Invariant: one reply line on its stdout per command; anything else it
    prints goes to its stderr. A process per mode, as a user runs one model: a
    step barrier (``torch_xla.sync()``, the fused step's cut) visits every live
    XLA tensor of its process, so trainers of other modes in the same process
    would make it pay for their tensors too (measured: 25 ms per barrier with
    15,000 live tensors, none pending). Only the process asked runs; the
    others wait on their stdin.
    """

    def __init__(self, name: str, module: str, *args: str) -> None:
        self.name = name
        env = dict(os.environ, PJRT_DEVICE=os.environ.get("PJRT_DEVICE", "CPU"))
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"{self.name}: the trainer's process exited ({self.proc.wait()}) at {command!r}")
        return reply

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def replies_on_stdout() -> TextIO:
    """In a served process: the real stdout, for replies; ``sys.stdout`` (prints, warnings) goes to stderr."""
    out, sys.stdout = sys.stdout, sys.stderr
    return out


def serve(cfg: dict) -> None:
    """One mode's step (``build_step(cfg)``) on command from stdin (see :class:`TrainerProcess`).

    ``warmup N``: N steps, drained; ``block N``: N steps, each waited for,
    their seconds as a JSON list.
    """
    out = replies_on_stdout()
    step, _ = build_step(cfg)
    for line in sys.stdin:
        command, n = line.split()
        times = []
        for _ in range(int(n)):
            t0 = time.perf_counter()
            step()
            xm.wait_device_ops()
            times.append(time.perf_counter() - t0)
        out.write(("ok" if command == "warmup" else json.dumps(times)) + "\n")
        out.flush()


def run_alternated(cfg: dict) -> dict:
    """Step time of several modes, each in a process of its own, their blocks alternated.

    Separate runs differ by more than the backends do (machine state,
    clocks); alternating blocks exposes every mode to the same machine state,
    which is what the step-time ratios need.
    """
    modes = cfg["modes"]
    procs = {m: TrainerProcess(f"{m} on {cfg['workload']}", "bench.worker", "--serve",
                               json.dumps(dict({k: v for k, v in cfg.items() if k != "modes"}, mode=m)))
             for m in modes}
    block, blocks = cfg.get("block", 5), cfg.get("blocks", 8)
    times: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for m in modes:  # one at a time: compiles do not compete for the cores
            procs[m].ask(f"warmup {cfg.get('warmup', 3)}")
        for i in range(blocks):
            for m in modes if i % 2 == 0 else modes[::-1]:
                times[m] += json.loads(procs[m].ask(f"block {block}"))
    finally:
        for p in procs.values():
            p.close()
    return dict(cfg, timing={m: _summary(t) for m, t in times.items()})


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(json.loads(sys.argv[2]))
    else:
        cfg = json.loads(sys.argv[1])
        print(json.dumps(run_alternated(cfg) if "modes" in cfg else run(cfg)))
