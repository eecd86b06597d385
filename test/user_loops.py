"""Training loops written the way users write them, runnable in a subprocess.

Each loop trains on XLA with a given backend (``None``: eager on the device
given) and returns a JSON-able record: the parameters after training (as
lists, for comparison with eager CPU), the losses, and the XLA executions of
every iteration after warm-up. ``python user_loops.py LOOP [LOOP ...] BACKEND``
runs the loops one after another in this process (dynamo reset between them)
and prints each record as one line of stdout as soon as it is done, so a test
can run loops that might crash the process (a segfault, an abort) in a
subprocess and still have every record before the crash (test_user_loops.py
starts the rest again in a fresh process).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any, Callable, Optional

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

Record = dict[str, Any]
LOOPS: dict[str, Callable[..., Record]] = {}


def loop(fn: Callable[..., Record]) -> Callable[..., Record]:
    LOOPS[fn.__name__] = fn
    return fn


class Run:
    """Device, compile and sync helpers shared by every loop; eager CPU when ``backend`` is None."""

    def __init__(self, backend: Optional[str], device: str = "xla") -> None:
        self.backend = backend
        self.on_xla = device == "xla"
        if self.on_xla:
            import torch_xla

            import torch_xla_bridge  # noqa: F401  (registers the backends)

            self.device = torch_xla.device()
        else:
            self.device = torch.device("cpu")
        self.per_iteration: list[int] = []
        self.compiles_per_iteration: list[int] = []
        self.errors: list[str] = []
        self._mark = self.executions()
        self._compiles_mark = self.compiles()
        self.caught = warnings.catch_warnings(record=True)
        self.warnings = self.caught.__enter__()
        warnings.simplefilter("always")

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, backend=self.backend) if self.backend else fn

    def sync(self) -> None:
        if self.on_xla:
            import torch_xla

            torch_xla.sync()

    def executions(self) -> int:
        if not self.on_xla:
            return 0
        # Imported here: eager CPU loops run without torch_xla.
        from torch_xla_bridge.counting import executions

        return executions()

    def compiles(self) -> int:
        """XLA compilations so far (torch_xla's ``UncachedCompile``)."""
        if not self.on_xla:
            return 0
        from torch_xla_bridge.counting import counter

        return counter("UncachedCompile")

    def folds(self) -> int:
        """Micro-batches openxla_fused_step folded into a loop so far (loops share a process: take differences)."""
        if not self.on_xla:
            return 0
        from torch_xla_bridge.counting import counter
        from torch_xla_bridge.names import FOLD_COUNTER

        return counter(FOLD_COUNTER)

    def end_iteration(self) -> None:
        now = self.executions()
        self.per_iteration.append(now - self._mark)
        self._mark = self.executions()
        compiles = self.compiles()
        self.compiles_per_iteration.append(compiles - self._compiles_mark)
        self._compiles_mark = compiles

    def record(self, models: dict[str, nn.Module], values: Any, **extra: Any) -> Record:
        self.caught.__exit__(None, None, None)
        params = {
            f"{m}.{k}": v.detach().cpu().tolist() for m, model in models.items() for k, v in model.state_dict().items()
        }
        ours = [str(w.message) for w in self.warnings if "openxla_fused" in str(w.message)]
        return dict(
            params=params, values=values, executions=self.per_iteration, compiles=self.compiles_per_iteration,
            warnings=ours, **extra,
        )


def _data(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mlp(d_in: int, width: int, d_out: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, width), nn.Tanh(), nn.Linear(width, d_out))


@loop
def gan(backend: Optional[str], device: str = "xla", steps: int = 5) -> Record:
    """Two optimizers, D's grads not zeroed before G's backward (G's loss flows through D), one sync per iteration."""
    r = Run(backend, device)
    G = _mlp(8, 32, 16, seed=1).to(r.device)
    D = _mlp(16, 32, 1, seed=2).to(r.device)
    opt_g = torch.optim.SGD(G.parameters(), lr=0.05, momentum=0.9)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    g, d = r.compile(G), r.compile(D)
    losses = []
    for i in range(steps):
        real = _data(100 + i, 16, 16).to(r.device)
        z = _data(200 + i, 16, 8).to(r.device)
        opt_d.zero_grad()
        fake = g(z)
        loss_d = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = F.softplus(-d(fake)).mean()
        loss_g.backward()  # accumulates into D's .grad too, read by nobody until the next zero_grad
        opt_g.step()
        r.sync()
        losses.append([loss_d.item(), loss_g.item()])
        r.end_iteration()
    return r.record({"G": G, "D": D}, values=losses)


@loop
def accumulation_with_grad_norms(backend: Optional[str], device: str = "xla", steps: int = 4) -> Record:
    """Gradient accumulation over 4 micro-batches, logging a lazy ``.grad`` statistic after each backward."""
    r = Run(backend, device)
    model = _mlp(16, 32, 4, seed=3).to(r.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fwd = r.compile(model)
    logged = []
    for i in range(steps):
        norms = []
        for k in range(4):
            x = _data(10 * i + k, 8, 16).to(r.device)
            y = _data(1000 + 10 * i + k, 8, 4).to(r.device)
            (F.mse_loss(fwd(x), y) / 4).backward()
            norms.append(torch.stack([p.grad.norm() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
        r.sync()
        logged.append(torch.stack(norms).cpu().tolist())
        r.end_iteration()
    return r.record({"model": model}, values=logged)


def _clip(backend: Optional[str], device: str, steps: int, set_to_none: bool) -> Record:
    r = Run(backend, device)
    model = _mlp(16, 32, 4, seed=4).to(r.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fwd, step = r.compile(model), r.compile(opt.step)
    norms = []
    for i in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        x = _data(i, 8, 16).to(r.device)
        y = _data(500 + i, 8, 4).to(r.device)
        F.mse_loss(fwd(x), y).backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        step()
        norms.append(total.item())  # read after the step: no sync of its own
        r.end_iteration()
    return r.record({"model": model}, values=norms)


@loop
def clip_compiled_optimizer(backend: Optional[str], device: str = "xla", steps: int = 5) -> Record:
    """``clip_grad_norm_`` + optimizer compiled with the same backend, ``zero_grad(set_to_none=False)``."""
    return _clip(backend, device, steps, set_to_none=False)


@loop
def clip_compiled_optimizer_set_to_none(backend: Optional[str], device: str = "xla", steps: int = 5) -> Record:
    """As :func:`clip_compiled_optimizer`, with ``zero_grad(set_to_none=True)``."""
    return _clip(backend, device, steps, set_to_none=True)


class _Counting(nn.Module):
    """A module that updates a buffer in place and returns a view of its input beside the output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.add_(1)
        h = self.lin(x)
        self.ema.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
        return torch.tanh(h), x[:, :4]


@loop
def input_mutations(backend: Optional[str], device: str = "xla", steps: int = 3) -> Record:
    """Graphs that write into their inputs (``copy_``, in-place ops) or return them (aliased outputs)."""
    r = Run(backend, device)

    def copy_into(a: torch.Tensor) -> torch.Tensor:
        torch.ops.aten.copy_.default(a, a.cos())
        return a * 2

    def in_place(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(b)
        b.mul_(0.5)
        return a + b

    def aliased(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return a, a.view(2, 2), a.sin()

    fns = [r.compile(copy_into), r.compile(in_place), r.compile(aliased)]
    a, b, c = (_data(s, 4).to(r.device) for s in (1, 2, 3))
    torch.manual_seed(0)
    model = _Counting().to(r.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fwd = r.compile(model)
    seen = []
    for i in range(steps):
        x = _data(50 + i, 4, 8).to(r.device)
        y, head = fwd(x)
        (y.square().mean() + head.sum() * 0).backward()
        opt.step()
        opt.zero_grad()
        outs = [fns[0](a), fns[1](b, c), *fns[2](a)]
        r.sync()
        seen.append([o.cpu().tolist() for o in outs] + [t.cpu().tolist() for t in (a, b, c)])
        r.end_iteration()
    return r.record({"model": model}, values=seen)


@loop
def item_after_eager_step(backend: Optional[str], device: str = "xla", steps: int = 5) -> Record:
    """An accelerate-style loop: eager AdamW, ``loss.item()`` after ``optimizer.step()``, no sync; then the model is read."""
    r = Run(backend, device)
    model = _mlp(16, 32, 4, seed=5).to(r.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fwd = r.compile(model)
    losses = []
    for i in range(steps):
        loss = F.mse_loss(fwd(_data(i, 8, 16).to(r.device)), _data(700 + i, 8, 4).to(r.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        r.end_iteration()
    before = r.executions()
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    model.cpu()
    read_after = r.executions() - before
    return r.record({"model": model}, values=losses, read_after_training=read_after, n_state=len(state))


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


@loop
def checkpointed_blocks(backend: Optional[str], device: str = "xla", steps: int = 4) -> Record:
    """Activation checkpointing around blocks compiled one by one (the forward runs under no_grad).

    On XLA users take torch_xla's checkpoint (torch's cannot save XLA's RNG
    state); it is reentrant only, so the input requires grad.
    """
    if device == "xla":
        from torch_xla.utils.checkpoint import checkpoint
    else:
        from torch.utils.checkpoint import checkpoint

    r = Run(backend, device)
    torch.manual_seed(6)
    blocks = nn.ModuleList(_Block(16) for _ in range(3)).to(r.device)
    head = nn.Linear(16, 4).to(r.device)
    opt = torch.optim.SGD(list(blocks.parameters()) + list(head.parameters()), lr=0.05, momentum=0.9)
    compiled = [r.compile(b) for b in blocks]  # each block compiled on its own
    losses = []
    for i in range(steps):
        h = _data(i, 8, 16).to(r.device).requires_grad_()
        for blk in compiled:
            h = checkpoint(blk, h, use_reentrant=True)
        loss = F.mse_loss(head(h), _data(300 + i, 8, 4).to(r.device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        r.sync()
        losses.append(loss.item())
        r.end_iteration()
    return r.record({"blocks": blocks, "head": head}, values=losses)


@loop
def bad_input_then_continue(backend: Optional[str], device: str = "xla", steps: int = 6) -> Record:
    """A step fed a wrong dtype (f64) or a wrong shape raises; the user catches it and trains on."""
    r = Run(backend, device)
    model = _mlp(16, 32, 4, seed=7).to(r.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fwd = r.compile(model)
    values: list[Any] = []
    for i in range(steps):
        x = _data(i, 8, 16)
        if i == 2:
            x = x.double()
        elif i == 4:
            x = x[:, :12]
        try:
            loss = F.mse_loss(fwd(x.to(r.device)), _data(900 + i, 8, 4).to(r.device))
            loss.backward()
            opt.step()
            r.sync()
            values.append(loss.item())
        except (RuntimeError, ValueError) as e:  # upstream raises XLA's ValueError
            values.append(-1.0)
            r.errors.append(str(e).splitlines()[0][:200])
        opt.zero_grad()
        r.end_iteration()
    return r.record({"model": model}, values=values, errors=r.errors)


class _TinyGPT(nn.Module):
    """nanoGPT's shape at toy size: token and position embeddings, pre-norm blocks with causal
    attention and a GELU MLP, a final norm, an LM head tied to the token embedding, and the loss
    computed inside ``forward`` (so it is part of the compiled graph). The attention's input
    projection has no bias (nanoGPT's ``bias=False``): the key bias's gradient is zero in exact
    arithmetic, and AdamW turns its rounding noise into full-size updates that differ by device."""

    def __init__(self, vocab: int = 48, block: int = 16, dim: int = 32, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(
                ln_1=nn.LayerNorm(dim), qkv=nn.Linear(dim, 3 * dim, bias=False), proj=nn.Linear(dim, dim),
                ln_2=nn.LayerNorm(dim), fc=nn.Linear(dim, 4 * dim), out=nn.Linear(4 * dim, dim),
            ))
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT, GPT-2 and Llama ties them

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln_1"](x)).split(x.shape[-1], dim=2)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](y.transpose(1, 2).reshape(b, t, -1))
            x = x + blk["out"](F.gelu(blk["fc"](blk["ln_2"](x))))
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@loop
def nanogpt_shaped(backend: Optional[str], device: str = "xla", steps: int = 6) -> Record:
    """karpathy/nanoGPT's train.py loop, written for CUDA: no sync anywhere, an eager AdamW whose lr is set
    in ``param_groups`` every iteration, 2 micro-batches of gradient accumulation, ``clip_grad_norm_``,
    ``zero_grad(set_to_none=True)``, ``loss.item()`` every iteration."""
    return _nanogpt(backend, device, steps, micro=2)


@loop
def nanogpt_shaped_accumulate8(backend: Optional[str], device: str = "xla", steps: int = 4) -> Record:
    """The same loop at 8 micro-batches per optimizer step (nanoGPT's GPT-2 config runs 40); the record
    also holds how often openxla_fused_step folded micro-batches into one loop."""
    return _nanogpt(backend, device, steps, micro=8)


def _nanogpt(backend: Optional[str], device: str, steps: int, micro: int) -> Record:
    r = Run(backend, device)
    torch.manual_seed(7)
    model = _TinyGPT().to(r.device)
    # `.to` replaces each Parameter on its own and so unties them on XLA (nn.Module._apply):
    # tie again, as the docs say, so that every device trains the same model.
    model.wte.weight = model.lm_head.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    fwd = r.compile(model)
    gen = torch.Generator().manual_seed(11)
    losses = []
    folds_before = r.folds()
    for i in range(steps):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * (i + 1) / steps  # warm-up, as nanoGPT's get_lr
        for _ in range(micro):
            idx = torch.randint(0, 48, (4, 16), generator=gen)
            _, loss = fwd(idx.to(r.device), idx.roll(-1, dims=1).to(r.device))
            (loss / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        r.end_iteration()
    return r.record({"model": model}, values=losses, folds=r.folds() - folds_before)


def main(argv: list[str]) -> None:
    import gc

    backend = None if argv[-1] == "eager" else argv[-1]
    for name in argv[:-1]:
        torch._dynamo.reset()
        gc.collect()  # the last loop's tensors, so that no pending IR of theirs joins this loop's executions
        print(json.dumps({"loop": name, "record": LOOPS[name](backend)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
