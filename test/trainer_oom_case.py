"""Hugging Face ``Trainer(auto_find_batch_size=True)`` on ``openxla_fused_step`` under a memory limit, run
by test_out_of_memory.py.

``python test/trainer_oom_case.py xla OUT`` limits the process's address space (RLIMIT_AS) to its size
once the XLA runtime is up plus ``LIMIT_GIB``, so that XLA's allocation for a step at the starting
batch fails at once, as a device too small would refuse it; accelerate's ``find_executable_batch_size``
retries at 0.9x the batch until a step fits, and training goes on for ``STEPS`` steps. Prints one JSON
line (``RESULT {...}``: the errors accelerate saw, the batch found, executions and compiles per step at
that batch) and saves the trained parameters to OUT.

``python test/trainer_oom_case.py cpu OUT BATCH`` trains the same model eagerly on the CPU at BATCH from
the start (no limit, no search) and saves its parameters to OUT: where the refused steps left
nothing behind, the two agree.

Data is read in order (a sequential sampler), so that a retry's batches are the CPU run's.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402

LIMIT_GIB = 3.0
# Each step at a batch of b needs one XLA allocation of about 9.4 MB * b (the logits, their softmax
# and gradients: measured 9.57 GB at 1024). Under LIMIT_GIB a batch of 400 is refused and about 230
# fits: 6 retries.
START_BATCH = 400
STEPS = 3
SEQ, VOCAB = 64, 8192


def trainer_parts(batch: int, use_cpu: bool, auto_find: bool) -> tuple[Any, Any, Any]:
    from train_hf_trainer import RandomTokens
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"trainer_oom_{os.getpid()}"),
        max_steps=STEPS, per_device_train_batch_size=batch, auto_find_batch_size=auto_find, use_cpu=use_cpu,
        learning_rate=3e-4, optim="adamw_torch", logging_steps=STEPS, report_to="none", save_strategy="no",
        dataloader_pin_memory=False, dataloader_drop_last=True, seed=0, disable_tqdm=True)
    return model, args, RandomTokens(STEPS * START_BATCH, SEQ, VOCAB)


def in_order(trainer_class: type) -> type:
    """``trainer_class`` reading its data in order."""

    class InOrder(trainer_class):  # type: ignore[misc,valid-type]
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder


def run_cpu(out: str, batch: int) -> None:
    from transformers import Trainer

    model, args, data = trainer_parts(batch, use_cpu=True, auto_find=False)
    in_order(Trainer)(model=model, args=args, train_dataset=data).train()
    torch.save({k: v.detach().cpu() for k, v in model.named_parameters()}, out)


def run_xla(out: str) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm

    import torch_xla_bridge  # noqa: F401
    from torch_xla_bridge import counting, names

    torch.ones(1, device=torch_xla.device()).cpu()  # the runtime's own memory is in place before the limit
    from transformers import Trainer, TrainerCallback

    import accelerate.utils.memory as accelerate_memory

    size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
    limit = size + int(LIMIT_GIB * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Each refused batch size is one more dynamo compilation of the model's forward: room for the search.
    torch._dynamo.config.recompile_limit = 32

    seen: list[dict[str, Any]] = []
    should_reduce = accelerate_memory.should_reduce_batch_size

    def observed(error: BaseException) -> bool:
        """accelerate's own decision, recorded with the error it was made on."""
        reduce = should_reduce(error)
        seen.append(dict(reduce=reduce, type=type(error).__name__, message=str(error)))
        return reduce

    accelerate_memory.should_reduce_batch_size = observed

    marks: list[tuple[int, int]] = []

    class Marks(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            xm.wait_device_ops()
            marks.append((counting.executions(), counting.counter(names.UNCACHED_COMPILE_COUNTER)))

    model, args, data = trainer_parts(START_BATCH, use_cpu=False, auto_find=True)
    model.compile(backend=names.STEP_BACKEND_NAME)
    trainer = in_order(Trainer)(model=model, args=args, train_dataset=data, callbacks=[Marks()])
    trainer.train()
    torch.save({k: v.detach().cpu() for k, v in model.named_parameters()}, out)
    steps = marks[-STEPS:]
    print("RESULT " + json.dumps(dict(
        seen=seen, batch=trainer._train_batch_size, steps=trainer.state.global_step,
        executions=[b[0] - a[0] for a, b in zip(steps, steps[1:])],
        compiles=[b[1] - a[1] for a, b in zip(steps, steps[1:])],
    )), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    if sys.argv[1] == "xla":
        run_xla(sys.argv[2])
    else:
        run_cpu(sys.argv[2], int(sys.argv[3]))
