"""torch_xla 2.9.0: the backward of a BatchNorm in evaluation mode fails.

A BatchNorm in ``eval()`` inside a model that is trained (statistics frozen while
fine-tuning) normalizes with its running statistics; its backward should too, as on
CPU. On XLA the forward saves empty tensors as the mean and inverse standard
deviation (as CPU does) and the backward's lowering then uses those instead of the
running statistics: "The size of mean should be compatible with feature count, but
the size of offset factor is 0". Eager XLA and compiled graphs alike.

    PJRT_DEVICE=CPU python upstream/bugs/batch_norm_eval_backward.py   # exit 1: bug present
"""

import copy
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch_xla  # noqa: E402


def main() -> int:
    dev = torch_xla.device()
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    cpu = nn.BatchNorm1d(4).eval()
    xla_models = {"eager XLA": copy.deepcopy(cpu).to(dev), "openxla": copy.deepcopy(cpu).to(dev)}
    cpu(x).square().sum().backward()
    wrong = False
    for name, m in xla_models.items():
        fn = torch.compile(m, backend="openxla") if name == "openxla" else m
        try:
            fn(x.to(dev)).square().sum().backward()
            torch_xla.sync()
            ok = torch.allclose(m.weight.grad.cpu(), cpu.weight.grad, rtol=1e-5, atol=1e-6)
            print(f"{name}: weight.grad {'matches' if ok else 'differs from'} eager CPU")
            wrong |= not ok
        except RuntimeError as e:
            print(f"{name}: backward fails: {str(e).splitlines()[0]}")
            wrong = True
    print("BUG: eval-mode BatchNorm cannot be differentiated on XLA" if wrong else "ok: eval-mode BatchNorm backward as eager CPU")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
