"""torch_xla 2.9.0: ``xs.mark_sharding`` inside ``torch.compile`` crashes dynamo, so ``torch.compile(FSDPv2(model))`` does.

``mark_sharding`` returns its tensor wrapped as an ``XLAShardedTensor``, a DTensor
subclass that inherits DTensor's ``__tensor_flatten__`` (``["_local_tensor"]``) but
has no ``_local_tensor``. Dynamo breaks the graph at the annotation (a pybind call)
and fails as soon as a traced frame holds the wrapper:
``InternalTorchDynamoError: AttributeError: 'XLAShardedTensor' object has no
attribute '_local_tensor'``. SpmdFullyShardedDataParallel's forward calls
``mark_sharding`` on its output, so the model compiled as users (and HF Trainer's
``xla_fsdp_v2``) write it never runs. Any backend; shown with upstream ``openxla``.

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python upstream/bugs/fsdpv2_compile_xlashardedtensor.py   # exit 1: bug present

Fix: ``mark-sharding-under-dynamo.patch`` (while dynamo traces, ``mark_sharding``
annotates the real tensor at a graph break and returns the tensor itself).
"""

import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel  # noqa: E402


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def main() -> int:
    assert "torch_xla_bridge" not in sys.modules
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "model"))
    dev = torch_xla.device()

    def annotate_intermediate(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        xs.mark_sharding(y, mesh, ("fsdp", None))
        return y + 1

    torch.manual_seed(0)
    wrapped = SpmdFullyShardedDataParallel(Model().to(dev), mesh=mesh)
    x = torch.randn(8, 16).to(dev)
    xs.mark_sharding(x, mesh, ("fsdp", None))
    cases = {
        "mark_sharding of an intermediate": (annotate_intermediate, annotate_intermediate),
        "torch.compile(FSDPv2(model))": (wrapped, wrapped),
    }
    failed = False
    for name, (fn, eager) in cases.items():
        torch._dynamo.reset()
        want = eager(x).cpu()
        try:
            got = torch.compile(fn, backend="openxla")(x).cpu()
        except Exception as e:  # noqa: BLE001  (dynamo wraps the AttributeError)
            print(f"{name:<34} FAILS: {type(e).__name__}: {str(e).splitlines()[0]}")
            failed = True
            continue
        ok = torch.allclose(got, want, atol=1e-6)
        print(f"{name:<34} runs, {'equal to' if ok else 'DIFFERS from'} lazy SPMD")
        failed |= not ok
    print("BUG: mark_sharding cannot run under torch.compile" if failed else "ok: mark_sharding runs under torch.compile")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
