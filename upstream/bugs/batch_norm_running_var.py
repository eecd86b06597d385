"""torch_xla 2.9.0: BatchNorm's running variance is updated with the biased batch variance.

Eager PyTorch updates ``running_var`` with the unbiased variance (divided by
``n - 1``, ``n`` the elements per channel); torch_xla's ``native_batch_norm`` lowering
uses the biased one (divided by ``n``), in eager XLA and in compiled graphs alike. After
one training forward on a batch of 8 the running variance moves by 7/8 of eager's
update; evaluation then normalizes with a variance that is too small.

    PJRT_DEVICE=CPU python upstream/bugs/batch_norm_running_var.py   # exit 1: bug present
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
    x = torch.randn(8, 4) * 3 + 1
    cpu = nn.BatchNorm1d(4)
    eager_xla = copy.deepcopy(cpu).to(dev)
    compiled_xla = copy.deepcopy(cpu).to(dev)
    cpu(x)
    eager_xla(x.to(dev))
    torch.compile(compiled_xla, backend="openxla")(x.to(dev))
    torch_xla.sync()
    want = cpu.running_var - 0.9  # the update: 0.1 * variance
    wrong = False
    print("update of running_var (0.1 * variance), per channel:")
    print("  eager CPU      ", [round(v, 5) for v in want.tolist()])
    for name, m in (("eager XLA", eager_xla), ("openxla", compiled_xla)):
        got = m.running_var.cpu() - 0.9
        print(f"  {name:<15}", [round(v, 5) for v in got.tolist()], " ratio", [round(v, 4) for v in (got / want).tolist()])
        wrong |= not torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    print("BUG: running_var uses the biased variance (ratio (n-1)/n = 0.875)" if wrong else "ok: running_var as eager CPU")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
