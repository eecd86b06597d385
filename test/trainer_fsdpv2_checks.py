"""HF Trainer's FSDPv2 path (``fsdp_config={"xla": True, "xla_fsdp_v2": True}``) with the model compiled by
Trainer's own switch (``torch_compile_backend=...``), against the same Trainer run uncompiled (lazy SPMD).

Run by test_upstream_accelerate.py with SPMD on 4 PJRT CPU devices, and with the accelerate
patch of upstream/accelerate/ first on the path (Trainer's switch goes through accelerate's
backend check). Every run trains a tiny HF Llama, the decoder layers auto-wrapped by Trainer
(``transformer_auto_wrap_policy`` over ``_no_split_modules``) and the whole model wrapped with
Trainer's ``shard_output``. Writes, per run: Trainer's logged losses, XLA executions per
loop iteration (``xm.wait_device_ops()`` at each step's end), and what was compiled
after each step (XLA programs, dynamo frames).

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU PYTHONPATH=PATCHED_ACCELERATE:. python test/trainer_fsdpv2_checks.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "4")

import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before anything touches a device; Trainer builds its ("fsdp", "tensor") mesh from the count

import torch  # noqa: E402
import torch._dynamo.utils  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import torch_xla_bridge  # noqa: E402,F401  (the checkout's backends; an installed package needs no import)
from torch_xla_bridge import counting  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_hf_trainer import RandomTokens  # noqa: E402

STEPS, BATCH, SEQ, VOCAB = 4, 8, 16, 128


class Record(TrainerCallback):
    """Executions of each loop iteration (from one step's end to the next's: the data loader's ``mark_step``
    runs a lazy step's work when it fetches the next batch), and what had been compiled at each step's end."""

    def __init__(self) -> None:
        self.executions: list[int] = []
        self.compiled: list[list[int]] = []
        self._last = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last = counting.executions()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = counting.executions()
        self.executions.append(now - self._last)
        self._last = now
        self.compiled.append([(met.metric_data("CompileTime") or (0,))[0],
                              torch._dynamo.utils.counters["frames"]["ok"]])


def train(backend: "str | None") -> dict[str, Any]:
    """Trainer on the FSDPv2 path; ``backend`` None: uncompiled."""
    # Accelerate keeps the first Accelerator's settings process-wide, and torch_compile_backend sets
    # ACCELERATE_DYNAMO_BACKEND for the process: each run starts without either.
    AcceleratorState._reset_state(True)
    os.environ.pop("ACCELERATE_DYNAMO_BACKEND", None)
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attn_implementation="eager")
    compile_args = {} if backend is None else {"torch_compile": True, "torch_compile_backend": backend}
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="trainer_fsdpv2_"), max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=3e-3, optim="adamw_torch", logging_steps=1, report_to="none", save_strategy="no",
        dataloader_pin_memory=False, dataloader_drop_last=True, seed=0,
        fsdp="full_shard", fsdp_config={"xla": True, "xla_fsdp_v2": True}, **compile_args)
    record = Record()
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=RandomTokens(STEPS * BATCH, SEQ, VOCAB),
                      callbacks=[record])
    trainer.train()
    return {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "executions": record.executions, "compiled": record.compiled,
            "wrapped": type(trainer.model).__name__,
            "layers_wrapped": sum(type(m).__name__ == "SpmdFullyShardedDataParallel" for m in trainer.model.modules())}


if __name__ == "__main__":
    result = {"uncompiled": train(None), "openxla_fused_step": train("openxla_fused_step")}
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
    print(json.dumps(result))
