"""Shared helpers for the test suite: execution counting, models, training loops, eager CPU references.

They need only torch and torch_xla, never this package: upstream/measure.py
uses them in a process that measures the upstream patch alone and asserts that
``torch_xla_bridge`` was never imported.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import pathlib
import warnings
from types import ModuleType
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met


def _names() -> ModuleType:
    """torch_xla_bridge/names.py, loaded by path: a leaf module, so no part of the package is imported."""
    path = pathlib.Path(__file__).resolve().parent.parent / "torch_xla_bridge" / "names.py"
    spec = importlib.util.spec_from_file_location("_torch_xla_bridge_names", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


names = _names()
UPSTREAM = names.UPSTREAM_BACKEND_NAME
FUSED = names.BACKEND_NAME
FUSED_STEP = names.STEP_BACKEND_NAME
SYNC_COUNTER = names.SYNC_COUNTER
STEP_COUNTER = names.STEP_COUNTER


def device() -> torch.device:
    return torch_xla.device()


def executions() -> int:
    """XLA programs executed so far in this process, after pending ones finish.

    The count of torch_xla_bridge.counting.executions(), over the same
    names.EXECUTE_METRICS; not imported from there, which would load the
    package (see the module's docstring).
    """
    xm.wait_device_ops()
    return sum((met.metric_data(m) or (0,))[0] for m in names.EXECUTE_METRICS)


def counter(name: str) -> int:
    """A torch_xla counter's value (0 before its first bump), as torch_xla_bridge.counting.counter()."""
    return met.counter_value(name) or 0


def pending(tensors: list[torch.Tensor]) -> list[bool]:
    """True for each tensor that holds pending IR (would need an execution to read)."""
    return list(torch_xla._XLAC._check_tensor_need_materialization(list(tensors)))


def live_xla_tensors() -> int:
    return counter("CreateXlaTensor") - counter("DestroyXlaTensor")


# --- models -------------------------------------------------------------------


def mlp(depth: int = 3, width: int = 32, d_in: int = 16, d_out: int = 4) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(d_in, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, d_out))
    return nn.Sequential(*layers)


class GraphBreakMLP(nn.Module):
    """A three-layer MLP whose forward dynamo compiles as three graphs (two graph breaks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.a(x))
        torch._dynamo.graph_break()
        x = F.relu(self.b(x))
        torch._dynamo.graph_break()
        return self.c(x)


class SmallCNN(nn.Module):
    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8) if batch_norm else nn.Identity()
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.norm(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class TinyTransformer(nn.Module):
    """A two-block causal LM whose output projection is the embedding matrix (tied weights).

    Tied in ``forward`` rather than by sharing a Parameter, because moving a
    module to XLA replaces each Parameter object and would untie them.
    """

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, seq: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        # No biases: the key bias has an exactly-zero true gradient (softmax is
        # shift-invariant), and AdamW would amplify its rounding noise, which
        # differs between any two devices, into lr-sized updates.
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True, bias=False
        )
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return F.linear(self.norm(h), self.embed.weight)


@dataclasses.dataclass
class Task:
    """A model factory with matching synthetic data and loss."""

    make: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mlp_task(**kw) -> Task:
    def batch(g: torch.Generator):
        return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)

    return Task(lambda: mlp(**kw), batch, F.mse_loss)


def cnn_task(batch_norm: bool = False) -> Task:
    def batch(g: torch.Generator):
        return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)

    return Task(lambda: SmallCNN(batch_norm), batch, F.cross_entropy)


def transformer_task() -> Task:
    def batch(g: torch.Generator):
        tokens = torch.randint(0, 32, (2, 9), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return Task(TinyTransformer, batch, loss)


def make_model(task: Task, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return task.make()


# --- training loops -------------------------------------------------------------


@dataclasses.dataclass
class StepRecord:
    forward: int
    backward: int
    optimizer: int
    loss: float
    grads_pending: int

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.optimizer


@dataclasses.dataclass
class RunResult:
    steps: list[StepRecord]
    model: nn.Module
    uncached_compiles: list[int]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    raise ValueError(name)


def train(
    task: Task,
    backend: Optional[str],
    *,
    steps: int = 5,
    optimizer: str = "momentum",
    set_to_none: bool = True,
    compiled_optimizer: bool = True,
    on_xla: bool = True,
    seed: int = 0,
    model: Optional[nn.Module] = None,
    shard_batch: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
) -> RunResult:
    """Trains ``task`` and records XLA executions per phase of every step.

    ``backend=None`` is eager (on CPU when ``on_xla`` is False). The forward
    and the loss run as one compiled function; ``compiled_optimizer`` compiles
    ``optimizer.step`` with the same backend, otherwise the step is eager and
    followed by ``xm.mark_step()``. ``shard_batch(x, y)`` annotates each
    batch on the device (SPMD) before the first step.
    """
    dev = device() if on_xla else torch.device("cpu")
    model = (model if model is not None else make_model(task, seed)).to(dev)
    model.train()
    opt = make_optimizer(optimizer, model.parameters())

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return task.loss(model(x), y)

    fwd = torch.compile(forward_loss, backend=backend) if backend else forward_loss
    step = torch.compile(opt.step, backend=backend) if backend and compiled_optimizer else opt.step
    g = torch.Generator().manual_seed(1234)
    batches = [tuple(t.to(dev) for t in task.make_batch(g)) for _ in range(steps)]
    if shard_batch is not None:
        for x, y in batches:
            shard_batch(x, y)
    if on_xla:
        xm.mark_step()
    records, uncached = [], []
    for x, y in batches:
        e0 = executions() if on_xla else 0
        opt.zero_grad(set_to_none=set_to_none)
        loss = fwd(x, y)
        e1 = executions() if on_xla else 0
        loss.backward()
        e2 = executions() if on_xla else 0
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        n_pending = sum(pending(grads)) if on_xla else 0
        step()
        if on_xla and not compiled_optimizer:
            xm.mark_step()
        e3 = executions() if on_xla else 0
        records.append(StepRecord(e1 - e0, e2 - e1, e3 - e2, loss.item(), n_pending))
        uncached.append(counter("UncachedCompile") if on_xla else 0)
    return RunResult(records, model, uncached)


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


# --- eager CPU references and warnings -------------------------------------------


def cpu_and_xla_copy(make: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A model built on the CPU after seeding, and an identical copy of it on the XLA device."""
    torch.manual_seed(seed)
    cpu_model = make()
    return cpu_model, copy.deepcopy(cpu_model).to(device())


@contextlib.contextmanager
def recorded_warnings() -> Iterator[list[warnings.WarningMessage]]:
    """Records every warning raised inside, repeats included (a warning once per step must show each time)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def messages_naming(caught: list[warnings.WarningMessage], backend: str) -> list[str]:
    """The recorded warnings' messages that name ``backend`` (ours start with the backend's name)."""
    return [str(w.message) for w in caught if backend in str(w.message)]


def assert_grads_match(
    model: nn.Module, cpu_model: nn.Module, scale: float = 1.0, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Asserts each parameter's ``.grad`` equals ``scale`` times the eager CPU reference's, in order.

    ``scale``: how many backward passes ``model`` accumulated per one of ``cpu_model``.
    """
    for (name, p), q in zip(model.named_parameters(), cpu_model.parameters(), strict=True):
        got, want = p.grad.detach().cpu(), scale * q.grad.detach()
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
