"""torch_xla 2.9.0, SPMD: reading the buffer handle of a result still in flight is a segfault.

Under SPMD an execution's results are ``PjRtShardedData`` placeholders with no shards
until the launch assigns them; ``PjRtShardedData::GetHandle`` returns
``shards[0]->GetHandle()`` without checking, so ``_get_tensors_handle`` and
``_get_tensors_xla_device_data_node`` (which dedups device data by handle, and which the
dynamo bridge calls while it traces) read past an empty vector. Without SPMD the same
read returns the placeholder's address, another number than once the buffer arrives.

Each read runs in a child process (it crashes); this script exits 1 while a read of a
result in flight crashes, 0 once none does.

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python upstream/bugs/spmd_placeholder_handle.py
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = r"""
import sys
import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

xr.use_spmd()
read = {"handle": torch_xla._XLAC._get_tensors_handle,
        "device_data_node": torch_xla._XLAC._get_tensors_xla_device_data_node}[sys.argv[1]]
n = xr.global_runtime_device_count()
big = torch.randn(2048, 2048).to(torch_xla.device())
xs.mark_sharding(big, xs.Mesh(np.arange(n), (n, 1)), (0, None))
seen = 0
for _ in range(20):
    fresh = big @ big.T
    torch_xla._XLAC._xla_sync_multi([fresh], devices=[], wait=False, sync_xla_data=True)
    if torch_xla._XLAC._is_placecholder(fresh):  # launched, its buffers not yet assigned
        seen += 1
        read([fresh * 1] if sys.argv[1] == "device_data_node" else [fresh])
    xm.wait_device_ops()
print(f"read {seen} results in flight", flush=True)
"""


def main() -> int:
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "4")
    print(f"torch {__import__('torch').__version__}, torch_xla {__import__('torch_xla').__version__}")
    crashed = []
    for api in ("handle", "device_data_node"):
        proc = subprocess.run([sys.executable, "-c", CHILD, api], capture_output=True, text=True, timeout=600)
        said = proc.stdout.strip().splitlines()[-1:] or [f"(nothing: exit status {proc.returncode})"]
        print(f"  {api:17s} exit status {proc.returncode:4d}  {said[0]}")
        if proc.returncode != 0:
            crashed.append(api)
    if crashed:
        print(f"BUG: reading a result in flight under SPMD crashes ({', '.join(crashed)})")
        return 1
    print("ok: results in flight are read without a crash")
    return 0


if __name__ == "__main__":
    sys.exit(main())
