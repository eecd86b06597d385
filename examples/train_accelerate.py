"""A Hugging Face Accelerate training loop on PyTorch/XLA with a torch.compile backend (GPT-2 from a tiny config).

The loop is the one Accelerate's documentation teaches; the backend string is the only
difference between runs:

    PJRT_DEVICE=CPU python examples/train_accelerate.py --backend openxla
    PJRT_DEVICE=CPU python examples/train_accelerate.py --backend openxla_fused_grad
    PJRT_DEVICE=CPU python examples/train_accelerate.py --backend openxla_fused_step

`--backend none` trains the model uncompiled (LazyTensor). Executions per step, and
why: docs/frameworks/accelerate.md. `--accumulate K` accumulates K micro-batches per
optimizer step with `accelerator.accumulate(model)`; `--prefetch` takes a step's K batches
from the loader before its micro-batch loop (as Trainer does), so the loader's syncs come
first and the step can run as one execution.
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Callable, Iterable, Iterator, Optional, Sequence, TypeVar

T = TypeVar("T")

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


def random_tokens(samples: int, seq: int, vocab: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Synthetic causal-LM data: fixed random token sequences, labels = inputs (the model shifts them)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (samples, seq), generator=g)
    return [{"input_ids": t, "labels": t} for t in tokens]


def step_by_step(loader: Iterable[T], k: int) -> Iterator[T]:
    """The loader's batches in order, each optimizer step's ``k`` taken from the loader before the first is used.

    torch_xla's MpDeviceLoader (what ``accelerator.prepare`` makes of a DataLoader on XLA)
    calls ``torch_xla.sync()`` as each batch is taken; taking a step's batches together puts
    those syncs before the step's work instead of between its micro-batches.
    """
    it = iter(loader)
    while group := list(itertools.islice(it, k)):
        yield from group


def main(argv: Optional[Sequence[str]] = None, on_step: Optional[Callable[[int], None]] = None) -> list[float]:
    """Trains and returns the loss of every step; ``on_step(step)`` runs after each (the tests count executions)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="openxla_fused_step", help="a torch.compile backend, or 'none'")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--prefetch", action="store_true", help="take a step's micro-batches from the loader first")
    ap.add_argument(
        "--compile-with", choices=("model", "framework"), default="model",
        help="framework: Accelerator(dynamo_backend=...), which needs accelerate with upstream/accelerate's patch",
    )
    args = ap.parse_args(argv)
    compile_model = args.backend != "none" and args.compile_with == "model"

    # With torch_xla installed, Accelerator picks the XLA device (PJRT_DEVICE) by itself.
    # Not Accelerator(dynamo_backend=...) by default: accelerate checks the name against
    # its own fixed list, which holds no XLA backend (upstream/accelerate/ has the fix).
    framework_compile: dict[str, str] = {}
    if args.backend != "none" and args.compile_with == "framework":
        framework_compile = {"dynamo_backend": args.backend}
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, **framework_compile)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512, n_positions=args.seq, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    if compile_model:
        # In place: the model keeps its class (what prepare() wraps and unwrap_model returns).
        model.compile(backend=args.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    data = random_tokens(args.steps * args.accumulate * args.batch, args.seq, config.vocab_size)
    # drop_last: one batch shape for every step (a smaller last batch would compile again).
    dataloader = DataLoader(data, batch_size=args.batch, drop_last=True)
    # Moves the model to the XLA device and wraps the loader in torch_xla's MpDeviceLoader,
    # which calls torch_xla.sync() at each batch.
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    losses = []  # one per optimizer step: the mean of its micro-batches' losses
    micro_losses: list[torch.Tensor] = []
    batches = step_by_step(dataloader, args.accumulate) if args.prefetch else dataloader
    model.train()
    for batch in batches:
        # accumulate(): backward() divides the loss by K, and the optimizer's step and
        # zero_grad act only at a step's last micro-batch (accelerator.sync_gradients).
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        micro_losses.append(loss)
        if not accelerator.sync_gradients:
            continue
        # Read after the optimizer step: with openxla_fused_step a read before it would
        # execute the forward on its own (docs/fused_step.md). Until an eager optimizer's
        # step ends the fused step, this read still does (docs/frameworks/accelerate.md).
        losses.append(sum(t.item() for t in micro_losses) / len(micro_losses))
        micro_losses.clear()
        step = len(losses) - 1
        # print, not accelerator.print: off TPU, accelerate takes the local process index from
        # LOCAL_RANK, -1 unless a launcher set it, and then accelerator.print prints nothing.
        print(f"step {step + 1}: loss {losses[-1]:.5f}")
        if on_step is not None:
            on_step(step)
    return losses


if __name__ == "__main__":
    main()
