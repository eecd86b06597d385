"""torch_xla 2.9.0: compiled dropout scales kept values by 1/p instead of 1/(1 - p), and the backward scales again.

In a torch.compile graph ``F.dropout(x, p, training=True)`` is ``aten.native_dropout``,
whose XLA lowering keeps a fraction ``1 - p`` of the values (right) but multiplies
them by ``1 / p`` and returns that scaled float mask; ``native_dropout_backward``
then multiplies by ``1 / (1 - p)`` once more. Eager XLA ``F.dropout`` is right (it
does not use this op). Eager CPU is the reference.

    PJRT_DEVICE=CPU python upstream/bugs/native_dropout_scale.py   # exit 1: bug present
"""

import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402


def scales(x: torch.Tensor, p: float, backend: str | None) -> tuple[float, float, float]:
    """(kept fraction, forward scale, backward scale) of dropout on ones."""
    x = x.detach().requires_grad_()
    fn = (lambda t: F.dropout(t, p, training=True))
    if backend is not None:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=backend)
    out = fn(x)
    out.sum().backward()
    if backend is not None:
        torch_xla.sync()
    out, grad = out.detach().cpu(), x.grad.cpu()
    kept = out != 0
    return kept.float().mean().item(), out[kept].mean().item(), grad[kept].mean().item()


def main() -> int:
    dev = torch_xla.device()
    wrong = False
    print(f"{'p':>4} {'run':>14} {'kept':>7} {'forward scale':>14} {'backward scale':>15}")
    for p in (0.1, 0.5, 0.9):
        want = scales(torch.ones(20000), p, None)
        got = scales(torch.ones(20000, device=dev), p, "openxla")
        for name, (kept, fwd, bwd) in (("eager CPU", want), ("openxla", got)):
            print(f"{p:>4} {name:>14} {kept:>7.4f} {fwd:>14.4f} {bwd:>15.4f}")
        wrong |= abs(got[1] - want[1]) > 1e-4 * want[1] or abs(got[2] - want[2]) > 1e-4 * want[2]
    print("BUG: compiled dropout is scaled wrongly" if wrong else "ok: compiled dropout scales as eager CPU")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
