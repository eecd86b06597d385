"""Hugging Face `Trainer` on PyTorch/XLA with a torch.compile backend (GPT-2 from a tiny config, no download).

The script is the one users already write for `Trainer`; the backend string is the only
difference between runs:

    PJRT_DEVICE=CPU python examples/train_hf_trainer.py --backend openxla
    PJRT_DEVICE=CPU python examples/train_hf_trainer.py --backend openxla_fused_grad
    PJRT_DEVICE=CPU python examples/train_hf_trainer.py --backend openxla_fused_step

`--backend none` trains the model uncompiled (LazyTensor). Executions per step, and why: docs/frameworks/trainer.md.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Optional, Sequence

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402


class RandomTokens(torch.utils.data.Dataset):
    """Synthetic causal-LM data: fixed random token sequences, labels = inputs (the model shifts them)."""

    def __init__(self, samples: int, seq: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (samples, seq), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def build(
    argv: Optional[Sequence[str]] = None,
    trainer_cls: type[Trainer] = Trainer,
    callbacks: Sequence[TrainerCallback] = (),
) -> Trainer:
    """The model, data and `Trainer`, ready for `.train()` (the tests pass a recording subclass)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="openxla_fused_step", help="a torch.compile backend, or 'none'")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step "
                    "(gradient_accumulation_steps; openxla_fused_step folds them into one loop)")
    ap.add_argument("--output-dir", default=None, help="default: a temporary directory")
    ap.add_argument(
        "--compile-with", choices=("model", "framework"), default="model",
        help="framework: TrainingArguments(torch_compile_backend=...), which needs accelerate with "
        "upstream/accelerate's patch",
    )
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512, n_positions=args.seq, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    # Compile in place, not `torch.compile(model)`: the model stays a GPT2LMHeadModel, so
    # Trainer still reads its forward's signature (to keep the dataset's columns) and can
    # save it. Trainer's own switch, TrainingArguments(torch_compile_backend=...), goes
    # through accelerate's fixed list of backend names, which holds no XLA backend
    # (upstream/accelerate/ has the fix). Compilation happens at the first call, after
    # Trainer has moved the model to the XLA device.
    if args.backend != "none" and args.compile_with == "model":
        model.compile(backend=args.backend)
    framework_compile: dict[str, str] = {}
    if args.backend != "none" and args.compile_with == "framework":
        framework_compile = {"torch_compile_backend": args.backend}

    training_args = TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="hf_trainer_"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=3e-4,
        weight_decay=0.01,
        # The default, adamw_torch_fused, has no XLA kernel; the plain AdamW runs its
        # update as lazy XLA ops, which openxla_fused_step folds into the step's execution.
        optim="adamw_torch",
        logging_steps=1,  # each logged step costs Trainer 4 executions of its own (docs/frameworks/trainer.md)
        report_to="none",  # no experiment trackers
        save_strategy="no",  # no checkpoints in a demo
        dataloader_pin_memory=False,  # pinned host memory is for CUDA; torch_xla's loader moves batches itself
        # One batch shape for every step: a smaller last batch would compile the step again.
        dataloader_drop_last=True,
        seed=0,
        **framework_compile,
    )
    dataset = RandomTokens(args.steps * args.batch * args.accumulate, args.seq, config.vocab_size)
    return trainer_cls(model=model, args=training_args, train_dataset=dataset, callbacks=list(callbacks))


def main(argv: Optional[Sequence[str]] = None) -> list[float]:
    """Trains and returns the loss Trainer logged at each step."""
    trainer = build(argv)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


if __name__ == "__main__":
    main()
