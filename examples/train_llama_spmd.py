"""A Llama-shaped decoder trained the way TPU users train large models, compiled with a torch.compile backend.

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python examples/train_llama_spmd.py --mesh 2d --backend openxla_fused_step
    PJRT_DEVICE=TPU python examples/train_llama_spmd.py --mesh fsdp --backend openxla_fused_step --hidden 2048 ...

One process drives every device of the slice (on a multi-host slice: this
script on every host): the mesh spans ``xr.global_runtime_device_count()``
devices, named ("fsdp", "model").

- ``--mesh fsdp``: mesh (n, 1); torch_xla's FSDPv2 (SpmdFullyShardedDataParallel)
  shards every parameter on "fsdp".
- ``--mesh 2d``: mesh (n / m, m), m = ``--model-axis``; tensor parallelism on
  "model" first (attention q/k/v and MLP gate/up split by output features,
  attention o and MLP down by input features, Megatron-style), then FSDPv2
  shards each of them and every other parameter on "fsdp".

The batch is split on "fsdp"; the logits are sharded as HF Trainer's
``xla_fsdp_v2`` path shards them. Every step: ``--accum`` micro-batches under
bf16 autocast, HF's non-reentrant gradient checkpointing, one AdamW step with a
cosine schedule with warm-up, ``torch_xla.sync()``. The optimizer stays eager:
a scheduler changes its float lr every step, which a compiled optimizer would
take as a new constant and recompile (eager, the lr is a device scalar of the
lazy graph; with ``openxla_fused_step`` the whole step is still one program).

``--backend lazy`` runs the same loop uncompiled (plain SPMD LazyTensor), the
reference. Prints per step the loss, the XLA executions and what was compiled,
and a JSON summary last (``--json PATH`` writes it to a file too).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Optional, Sequence

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before anything touches a device

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch._dynamo.utils  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup  # noqa: E402

# Registers the backends (an installed package does through its entry point) and lets dynamo trace
# FSDPv2's output annotation, a mark_sharding call, with any backend, upstream openxla included.
import torch_xla_bridge  # noqa: E402,F401

# Tensor parallelism (Megatron): these layers' outputs are split on "model" (their weight's dim 0) ...
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# ... and these layers read the split activations (their weight's dim 1), so the partitioner reduces once after them.
ROW_PARALLEL = ("o_proj", "down_proj")


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="openxla_fused_step", help="a torch.compile backend, or lazy (uncompiled)")
    ap.add_argument("--mesh", choices=("fsdp", "2d"), default="fsdp")
    ap.add_argument("--model-axis", type=int, default=2, help="size of the mesh's 'model' axis with --mesh 2d")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps")
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--batch", type=int, default=8, help="global micro-batch, split on 'fsdp'")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=2, help="scheduler warm-up steps")
    ap.add_argument("--no-bf16", dest="bf16", action="store_false", help="float32 instead of bf16 autocast")
    ap.add_argument("--no-checkpoint", dest="checkpoint", action="store_false", help="no activation checkpointing")
    ap.add_argument("--json", help="also write the summary to this file")
    return ap.parse_args(argv)


def make_mesh(kind: str, model_axis: int) -> xs.Mesh:
    """("fsdp", "model") over every device of the slice: (n, 1), or (n / model_axis, model_axis)."""
    n = xr.global_runtime_device_count()
    m = 1 if kind == "fsdp" else model_axis
    if n % m:
        raise SystemExit(f"--model-axis {m} does not divide the {n} devices")
    return xs.Mesh(np.arange(n), (n // m, m), ("fsdp", "model"))


def shard_tensor_parallel(model: torch.nn.Module, mesh: xs.Mesh) -> None:
    """Splits attention and MLP weights on "model" (and on "fsdp" along the other dim); FSDPv2 then
    leaves them as they are (it only shards parameters that have no sharding yet)."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN_PARALLEL:
            xs.mark_sharding(module.weight, mesh, ("model", "fsdp"))
        elif leaf in ROW_PARALLEL:
            xs.mark_sharding(module.weight, mesh, ("fsdp", "model"))


def shard_logits(output: Any, mesh: xs.Mesh) -> None:
    """FSDPv2's output annotation as HF Trainer's ``xla_fsdp_v2`` path writes it (the model returns a dict)."""
    xs.mark_sharding(output.logits, mesh, ("fsdp", None, None))


def executions() -> int:
    """XLA programs executed so far (one per SPMD program, not per device), after pending ones finish."""
    xm.wait_device_ops()
    return sum((met.metric_data(m) or (0,))[0] for m in ("ExecuteTime", "ExecuteReplicatedTime"))


def compiled() -> dict[str, int]:
    """What has been compiled so far: XLA programs (``CompileTime``) and dynamo frames."""
    return {"xla_programs": (met.metric_data("CompileTime") or (0,))[0],
            "dynamo_frames": torch._dynamo.utils.counters["frames"]["ok"]}


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Trains ``args.steps`` optimizer steps; losses (per optimizer step, summed over micro-batches), executions
    and compile counts per step."""
    mesh = make_mesh(args.mesh, args.model_axis)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                         attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch_xla.device())
    if args.checkpoint:
        # preserve_rng_state=False: Llama has no dropout, and uncompiled (lazy) checkpointing would ask for a
        # torch.xla device module to save RNG state, which torch_xla does not register.
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False})
    if args.mesh == "2d":
        shard_tensor_parallel(model, mesh)
    model = SpmdFullyShardedDataParallel(model, mesh=mesh, shard_output=shard_logits)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    forward = model if args.backend == "lazy" else torch.compile(model, backend=args.backend)

    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"args": vars(args), "devices": xr.global_runtime_device_count(),
                           "mesh": list(mesh.mesh_shape), "losses": [], "executions": [], "compiled": [], "lr": [], "step_s": []}
    for step in range(args.steps):
        before, start = executions(), time.perf_counter()
        # Each micro-batch's loss is kept as the model returned it and summed after the step: a sum
        # taken lazily inside the loop (`total += loss.detach()`) would keep every micro-batch's
        # forward in the fused step's program beside the loop it folds them into (docs/fused_step.md).
        losses = []
        for _ in range(args.accum):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(torch_xla.device())
            xs.mark_sharding(ids, mesh, ("fsdp", None))
            with torch.autocast("xla", dtype=torch.bfloat16, enabled=args.bf16):
                loss = forward(input_ids=ids, labels=ids).loss
            (loss / args.accum).backward()
            losses.append(loss)
        out["lr"].append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        torch_xla.sync()
        out["executions"].append(executions() - before)
        out["step_s"].append(time.perf_counter() - start)  # the first steps include compiling
        out["compiled"].append(compiled())
        # After the step's executions were counted: reading the losses, device data now, runs nothing more.
        out["losses"].append(sum(loss.item() for loss in losses) / args.accum)
        print(f"step {step + 1}: loss {out['losses'][-1]:.5f}, lr {out['lr'][-1]:.2e}, {out['step_s'][-1]:.2f} s, "
              f"{out['executions'][-1]} executions, compiled so far {out['compiled'][-1]}", flush=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse(argv)
    out = train(args)
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
