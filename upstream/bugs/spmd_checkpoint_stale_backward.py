"""torch_xla 2.9.0, SPMD: ``openxla``'s checkpointed backward reuses the first call's parameters and batch.

Under SPMD a device-data tensor's buffer records a fresh tensor id every time the
tensor's IR value is taken (here: two queries in a row give two ids; without SPMD
the tensor's own id, every time). Upstream's dynamo bridge matches a traced graph's
device-data inputs to its arguments by that recorded id (``GraphInputMatcher``); an
input it cannot match is bound as a constant, the buffer it had at the trace. A
forward graph is the first to take its arguments' IR, so its ids match. The backward
of a block under ``torch.utils.checkpoint(..., use_reentrant=False)`` recomputes the
forward from the block's inputs, the parameters and the batch, whose IR the forward
took already: none of them matches, all are bound as constants, and every later
backward computes the gradient of the first batch at the first parameters. (Without
checkpointing only the batch, read by the first layer's weight gradient, is hit:
gradients off in every step after the first; see docs/spmd.md.)

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python upstream/bugs/spmd_checkpoint_stale_backward.py   # exit 1: bug present

Prints, per step, the largest difference between ``openxla``'s gradients and eager
CPU's for that step's batch and for the first batch; lazy SPMD (no torch.compile,
the same model without checkpointing: lazy SPMD rejects non-reentrant
checkpointing) for reference.
"""

import copy
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402

STEPS = 3


def recorded_ids() -> tuple[list[int], int]:
    """The ids recorded on a device tensor's buffer by two queries in a row, and the tensor's own id."""
    t = torch.ones(8, 4).to(torch_xla.device())
    ids = [int(torch_xla._XLAC._get_tensors_xla_device_data_node([t])[0][0]) for _ in range(2)]
    return ids, torch_xla._XLAC._xla_get_tensor_id(t)


def record_constant_inputs() -> list[list[tuple[int, ...]]]:
    """Per graph upstream's bridge traces: the shapes of its non-scalar inputs bound as constants."""
    import torch_xla._dynamo.dynamo_bridge as bridge

    seen: list[list[tuple[int, ...]]] = []
    init = bridge.GraphInputMatcher.__init__

    def recording_init(self, tensor_id_to_arg_idx, ids, values, arg_ids) -> None:
        init(self, tensor_id_to_arg_idx, ids, values, arg_ids)
        seen.append([tuple(v.shape) for v, i in zip(values, self.arg_idxs) if i is None and v.dim() > 0])

    bridge.GraphInputMatcher.__init__ = recording_init
    return seen


def max_grad_err(model: nn.Module, ref: nn.Module) -> float:
    return max((p.grad.cpu() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


def main() -> int:
    assert "torch_xla_bridge" not in sys.modules
    ids, own = recorded_ids()
    print(f"ids recorded on a device tensor's buffer, two queries: {ids} (the tensor's own id: {own})")

    constants = record_constant_inputs()
    dev = torch_xla.device()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    compiled_model, lazy_model = copy.deepcopy(cpu).to(dev), copy.deepcopy(cpu).to(dev)
    loss_fn = lambda model, x: model(x).pow(2).mean()  # noqa: E731
    checkpointed = lambda x: torch.utils.checkpoint.checkpoint(compiled_model, x, use_reentrant=False)  # noqa: E731
    step = torch.compile(lambda x: checkpointed(x).pow(2).mean(), backend="openxla")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 16, generator=g) for _ in range(STEPS)]
    cpu_first = copy.deepcopy(cpu)
    loss_fn(cpu_first, batches[0]).backward()

    print(f"{'step':>4}  {'openxla vs its batch':>20}  {'openxla vs batch 0':>18}  {'lazy SPMD vs its batch':>22}")
    wrong = False
    for i, batch in enumerate(batches):
        x = batch.to(dev)
        xs.mark_sharding(x, mesh, ("data", None))
        for model in (compiled_model, lazy_model, cpu):
            model.zero_grad()
        step(x).backward()
        loss_fn(lazy_model, x).backward()
        xm.mark_step()
        loss_fn(cpu, batch).backward()
        err, err_first, err_lazy = (max_grad_err(compiled_model, cpu), max_grad_err(compiled_model, cpu_first),
                                    max_grad_err(lazy_model, cpu))
        print(f"{i:>4}  {err:>20.2e}  {err_first:>18.2e}  {err_lazy:>22.2e}")
        wrong |= err > 1e-5
    print(f"inputs bound as constants, forward graph: {constants[0]}, backward graph: {constants[1]}")
    print("BUG: openxla's checkpointed backward under SPMD reuses the first batch" if wrong
          else "ok: openxla's checkpointed backward under SPMD follows the batch")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
