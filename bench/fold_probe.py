"""Feasibility probe for accumulation as a loop: K deferred (forward, backward) calls folded into one XLA While.

Not used by the package. Under ``openxla_fused_step`` each micro-batch's
forward and backward are embedded as one pending node each, calls of the same
two lowered computations on different inputs; the step's program inlines all
K pairs, so its compile time and memory grow with K (`python -m
bench.accumulation`). This probe records every embedded call of a step (the
lowered computation, the inputs it was given, its results), then builds from
the *same* two computations

    loop i in [0, K): out = F(inputs of call i); g = B(out's saved values, the tangent of call i);
                      acc += g; losses[i] = out[0]

(inputs that are the same tensor in every call passed once, the others stacked
along a new first dimension and sliced per iteration; backward inputs that are
results of their own forward wired inside the body), executes it, and compares
its gradients and losses with the unrolled step's, and XLA's compile time of
the loop with that of the unrolled step, per K.

    PJRT_DEVICE=CPU python -m bench.fold_probe --ks 1,4,16

Measured (2 cores, PJRT CPU, 3-layer MLP of width 256, batch 64): every
gradient equal to the unrolled step's within 1e-6 and every loss equal, at
each K; XLA compile time of the loop flat in K, the unrolled step's growing.
What the package still needs to fold a real step is in issue 39's notes:
when to fold (the optimizer step), mapping the backward's outputs to each
parameter's ``.grad`` (the backward node's AccumulateGrad edges), the losses'
and state's new values, and falling back where calls differ.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any, Iterable

os.environ.setdefault("PJRT_DEVICE", "CPU")


def probe(k: int, width: int) -> str:
    """One K in this process: the comparison line."""
    import torch
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import torch_xla.debug.metrics as met

    from torch_xla_bridge import deferred

    calls: list[tuple[Any, list[torch.Tensor], list[torch.Tensor]]] = []
    original = deferred._LoweredGraph.__call__

    def recording(self: Any, args: Any) -> Any:
        outs, results = original(self, args)
        assert self.seed is None and not any(isinstance(s, deferred._Packed) for s in self.sources)
        calls.append((self, [args[s] if type(s) is int else s for s in self.sources], list(results)))
        return outs, results

    deferred._LoweredGraph.__call__ = recording
    dev = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                torch.nn.Tanh(), torch.nn.Linear(width, 10)).to(dev)
    xs = [torch.randn(64, width).to(dev) for _ in range(k)]
    ys = [torch.randint(0, 10, (64,)).to(dev) for _ in range(k)]
    fwd = torch.compile(lambda x, y: torch.nn.functional.cross_entropy(model(x), y) / k,
                        backend="openxla_fused_step")

    def compile_s() -> float:
        return (met.metric_data("CompileTime") or (0, 0.0))[1] / 1e9

    line = ""
    for step in range(2):  # the second step: everything cached
        calls.clear()
        for p in model.parameters():
            p.grad = None
        losses = []
        for x, y in zip(xs, ys):
            loss = fwd(x, y)
            loss.backward()
            losses.append(loss)
        acc, folded_losses = _fold(calls, k, dev, xb)
        c0 = compile_s()
        torch_xla._XLAC._xla_sync_multi([*acc, folded_losses], [], True, False)
        c1 = compile_s()
        torch_xla._XLAC._xla_sync_multi([*(p.grad for p in model.parameters()), *losses], [], True, False)
        c2 = compile_s()
        ref = [p.grad.cpu() for p in model.parameters()]
        ref_losses = [x.item() for x in losses]
        got = [a.cpu() for a in acc]
        matched = sum(any(g.shape == r.shape and torch.allclose(g, r, rtol=0, atol=1e-6) for g in got) for r in ref)
        loss_diff = max(abs(a - b) for a, b in zip(folded_losses.cpu().tolist(), ref_losses))
        if step == 0:
            line = (f"| {k} | {matched}/{len(ref)} | {loss_diff:.1e} | {c1 - c0:.2f} | {c2 - c1:.2f} |")
    return line


def _fold(calls: list, k: int, dev: Any, xb: Any) -> tuple[list, Any]:
    """The loop over the recorded (forward, backward) calls; its summed gradients and stacked losses."""
    import torch
    import torch_xla

    lf, lb = calls[0][0], calls[1][0]
    assert all(c[0] is (lf if i % 2 == 0 else lb) for i, c in enumerate(calls)), "calls are not F, B, F, B, ..."
    fs, bs = calls[0::2], calls[1::2]

    def same(ts: list) -> bool:
        return all(t is ts[0] for t in ts)

    # A backward input: a result of its own forward (its index there), or from outside (None).
    b_src = []
    for j in range(len(bs[0][1])):
        idx = {next((n for n, r in enumerate(f[2]) if r is b[1][j]), None) for f, b in zip(fs, bs)}
        b_src.append(idx.pop() if len(idx) == 1 else None)
    params: list[torch.Tensor] = []
    layout: list[tuple[str, int, bool]] = []  # (graph, input, same in every call)
    for kind, recs, positions in (("F", fs, range(len(fs[0][1]))),
                                  ("B", bs, [j for j, s in enumerate(b_src) if s is None])):
        for j in positions:
            ts = [r[1][j] for r in recs]
            params.append(ts[0] if same(ts) else torch.stack(ts))
            layout.append((kind, j, same(ts)))
    acc0 = [torch.zeros_like(r) for r in bs[0][2]]
    tensors = [torch.zeros((), dtype=torch.int32, device=dev), *params, *acc0, torch.zeros(k, device=dev)]
    builder = xb.create_builder("fold")
    ops = [xb.mkparam(builder, n, xb.tensor_shape(t)) for n, t in enumerate(tensors)]

    def body(i: Any, *rest: Any) -> tuple:
        p, acc, losses = list(rest[:len(params)]), list(rest[len(params):-1]), rest[-1]

        def at_i(x: Any) -> Any:
            sizes = list(x.shape().sizes)
            sliced = x.dynamic_slice([i] + [i.zeros_like() for _ in sizes[1:]], [1] + sizes[1:])
            return sliced.reshape(sizes[1:])

        f_in, b_ext = [], {}
        for (kind, j, invariant), op in zip(layout, p):
            v = op if invariant else at_i(op)
            if kind == "F":
                f_in.append(v)
            else:
                b_ext[j] = v
        fo = xb.Op.call(lf.computation, f_in)
        bo = xb.Op.call(lb.computation, [fo.get_tuple_element(s) if s is not None else b_ext[j]
                                          for j, s in enumerate(b_src)])
        acc = [a + bo.get_tuple_element(j) for j, a in enumerate(acc)]
        losses = losses.dynamic_update_slice(fo.get_tuple_element(0).reshape([1]), [i])
        return (i + xb.Op.scalar(i.builder(), 1, dtype=xb.Type.S32), *p, *acc, losses)

    def cond(i: Any, *rest: Any) -> Any:
        return i < xb.Op.scalar(i.builder(), k, dtype=xb.Type.S32)

    loop = xb.Op.mkwhile(ops, cond, body).build("fold_loop")
    results = torch_xla._XLAC._xla_user_computation("xla::fold_loop", tensors, loop)
    return list(results[1 + len(params):-1]), results[-1]


def main(argv: Iterable[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,4,16")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one K, in this process
    args = ap.parse_args(argv)
    if args.one:
        print(probe(args.one, args.width))
        return
    print("| K | gradients equal (1e-6) | max loss difference | XLA compile s, loop | XLA compile s, unrolled step |")
    print("|---|---|---|---|---|")
    for k in args.ks.split(","):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "bench.fold_probe", "--one", k, "--width", str(args.width)],
                             capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
