"""A Hugging Face causal-LM training loop (GPT-2 from a tiny config, no download), compiled for XLA.

The loop is the one users already run; the backend string is the only change:

    PJRT_DEVICE=CPU python examples/train_causal_lm.py --backend openxla
    PJRT_DEVICE=CPU python examples/train_causal_lm.py --backend openxla_fused_grad
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="openxla_fused_grad")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    args = ap.parse_args(argv)

    device = torch_xla.device()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=512, n_positions=args.seq, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    compiled = torch.compile(model, backend=args.backend)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.steps, args.accumulate, args.batch, args.seq), generator=g)

    losses = []
    model.train()
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(args.accumulate):
            ids = tokens[step, micro].to(device)
            loss = compiled(input_ids=ids, labels=ids).loss / args.accumulate
            loss.backward()
        optimizer.step()
        torch_xla.sync()
        losses.append(loss.item() * args.accumulate)
        print(f"step {step + 1}: loss {losses[-1]:.5f}")
    return losses


if __name__ == "__main__":
    main()
