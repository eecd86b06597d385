"""Where fusing is impossible: upstream behaviour, correct, said once; bad input: a clear error."""

from unittest import mock

import pytest
import torch
import torch.nn as nn

from torch_xla_bridge.deferred import DeferredGraph
from xla_helpers import (
    FUSED,
    FUSED_STEP,
    UPSTREAM,
    assert_grads_match,
    cpu_and_xla_copy,
    device,
    executions,
    messages_naming,
    mlp,
    pending,
    recorded_warnings,
)


def run_steps(model: nn.Module, loss_of, steps: int = 2, **backward_kw):
    """Trains the compiled `model` for `steps` steps; returns the messages of the warnings our backend gave."""
    compiled = torch.compile(model, backend=FUSED)
    with recorded_warnings() as caught:
        for _ in range(steps):
            model.zero_grad()
            loss_of(compiled).backward(**backward_kw)
    return messages_naming(caught, FUSED)


def assert_falls_back_once(make_model, reason: str, steps: int = 2, **backward_kw) -> None:
    """Runs a model on XLA; asserts one warning containing `reason` and gradients equal to eager CPU."""
    cpu_model, model = cpu_and_xla_copy(make_model)
    x = torch.randn(8, 16)

    def loss_of(m):
        return m(x.to(next(m.parameters()).device)).square().mean()

    ours = run_steps(model, loss_of, steps=steps, **backward_kw)
    assert len(ours) == 1, ours
    assert reason in ours[0]
    cpu_model.zero_grad()
    loss_of(cpu_model).backward(**backward_kw)
    assert_grads_match(model, cpu_model)


def test_create_graph_falls_back_with_one_warning():
    assert_falls_back_once(mlp, "create_graph=True", steps=3, create_graph=True)


class LogGamma(nn.Module):
    """lgamma's backward needs digamma, which torch_xla runs on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return torch.lgamma(self.fc(x).abs() + 1.5)


def test_cpu_fallback_op_in_backward_falls_back_with_one_warning():
    probe = DeferredGraph._probe
    with mock.patch.object(DeferredGraph, "_probe", autospec=True, side_effect=probe) as probed:
        assert_falls_back_once(LogGamma, "CPU fallback): aten::digamma", steps=3)
    assert probed.call_count == 1  # the verdict is cached per signature


class NoisyIdentity(torch.autograd.Function):
    """Identity whose backward adds uniform noise in [0, 1) to the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g + torch.rand_like(g)


def test_random_op_in_backward_is_fused_and_reseeded_every_call():
    """The lowered backward takes the device's RNG seed as an input: fresh noise per call, no fallback."""
    torch.manual_seed(0)
    lin = nn.Linear(16, 4).to(device())
    compiled = torch.compile(lambda x: NoisyIdentity.apply(lin(x)), backend=FUSED)
    x = torch.randn(8, 16).to(device())
    grads, execs = [], []
    with recorded_warnings() as caught:
        for _ in range(3):
            lin.zero_grad()
            e0 = executions()
            compiled(x).sum().backward()
            execs.append(executions() - e0)
            grads.append(lin.bias.grad.cpu())
    assert messages_naming(caught, FUSED) == []
    assert execs[1:] == [2, 2]  # forward, backward with accumulation
    for g in grads:  # d(sum)/d(bias) = sum over 8 rows of (1 + noise in [0, 1))
        assert ((g >= 8) & (g < 16)).all(), g
    assert not torch.equal(grads[0], grads[1]) and not torch.equal(grads[1], grads[2])


def test_torch_xla_eager_mode_falls_back_with_one_warning():
    from torch_xla.experimental.eager import eager_mode_context

    with eager_mode_context(True):
        assert_falls_back_once(mlp, "eager mode")


def test_fused_path_warns_nothing():
    model = mlp().to(device())
    x = torch.randn(8, 16).to(device())
    assert run_steps(model, lambda m: m(x).sum(), steps=2) == []
    assert not any(pending([p.grad for p in model.parameters()]))


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_model_on_cpu_trains_like_upstream(backend):
    """No input on XLA at all: upstream warns and runs the graph on the CPU; so do we."""
    torch.manual_seed(0)
    model, cpu_model = mlp(), mlp()
    cpu_model.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(8, 16)
    with recorded_warnings() as caught:
        compiled(x).square().mean().backward()
    assert any("Found tensor with shape" in str(w.message) for w in caught)
    cpu_model(x).square().mean().backward()
    assert {p.grad.device.type for p in model.parameters()} == {"cpu"}
    assert_grads_match(model, cpu_model)


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_data_input_on_cpu_trains_like_upstream(backend):
    """A CPU batch moved inside the graph: upstream warns and runs it; so do we, correctly."""
    cpu_model, model = cpu_and_xla_copy(mlp)
    dev = device()
    compiled = torch.compile(lambda x: model(x.to(dev)), backend=backend)
    x = torch.randn(8, 16)
    with recorded_warnings() as caught:
        for _ in range(2):
            compiled(x).square().mean().backward()
    messages = [str(w.message) for w in caught]
    assert any("Found tensor with shape torch.Size([8, 16]) on cpu" in m for m in messages), messages
    cpu_model(x).square().mean().backward()
    assert_grads_match(model, cpu_model, scale=2)  # two backward passes accumulated against one
    if backend == FUSED:
        # Only the forward meets the CPU input: the backward stays fused, no .grad left pending.
        assert not any(pending([p.grad for p in model.parameters()]))
        assert not any(backend in m for m in messages), messages
    else:
        ours = [m for m in messages if backend in m]
        assert len(ours) == 1 and "is on cpu, not on an XLA device" in ours[0], ours


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_inference_graph_on_cpu_runs_like_upstream(backend):
    """All inputs on the CPU (as in upstream's own bridge tests): upstream's warning and result."""
    f = torch.compile(lambda a, b: a @ b + 1, backend=backend)
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    with recorded_warnings() as caught:
        out = f(a, b)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, a @ b + 1)
    assert any("on cpu. Please move all tensors to xla device" in str(w.message) for w in caught)


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
@pytest.mark.parametrize("fn", [lambda t: t.cpu(), lambda t: (t * 2).cpu()], ids=["input", "result"])
def test_graph_returning_a_device_value_on_cpu_runs_like_upstream(backend, fn):
    """``.cpu()`` of a device value needs an execution: the graph runs unfused, said once, and gives eager's values.

    (pytorch/xla's test_bridge.py test_cpu_flag_unsupported: its first shape aborted the lowering.)
    """
    t = torch.randint(0, 5, (3,)).to(device())
    f = torch.compile(fn, backend=backend)
    with recorded_warnings() as caught:
        outs = [f(t), f(t)]
    for out in outs:
        assert out.device.type == "cpu"
        torch.testing.assert_close(out, fn(t.cpu()))
    ours = messages_naming(caught, backend)
    if backend == FUSED:  # a graph without backward is upstream's already: nothing to say
        assert ours == [], ours
    else:
        assert len(ours) == 1 and "returns a CPU tensor computed from device values" in ours[0], ours


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_parameter_on_cpu_is_a_clear_error(backend):
    """A parameter left on the CPU beside XLA ones: upstream would train it on the CPU, silently."""
    model = mlp().to(device())
    bias = torch.zeros(4, requires_grad=True)
    compiled = torch.compile(lambda x, b: model(x) + b.to(x.device), backend=backend)
    with pytest.raises(Exception, match=rf"backend='{backend}': graph input 'l_b_' \(shape \(4,\).*requires grad\) is on device cpu"):
        compiled(torch.randn(8, 16).to(device()), bias)


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_compiled_autograd_says_the_backward_is_not_fused(backend):
    """Compiled autograd traces the backward itself: correct gradients, one warning naming it."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    cpu_model, model = cpu_and_xla_copy(mlp)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(8, 16)
    with recorded_warnings() as caught:
        for _ in range(2):
            # .sum(): with .mean() compiled autograd's graph gets a CPU scalar that upstream's
            # bridge rejects ("Expected XLA tensor"), with upstream openxla too.
            loss = compiled(x.to(device())).square().sum()
            with compiled_autograd._enable(torch.compile(backend=backend)):
                loss.backward()
    ours = messages_naming(caught, backend)
    assert len(ours) == 1 and "compiled autograd is enabled" in ours[0], ours
    cpu_model(x).square().sum().backward()
    assert_grads_match(model, cpu_model, scale=2)  # two backward passes accumulated against one


def _mul_foobar_mul(t: torch.Tensor) -> torch.Tensor:
    # aten::_foobar has no XLA lowering (torch's op for testing): it runs through the CPU fallback.
    return torch.mul(torch._foobar(torch.mul(t, 2)), 2)


def _executions_of_two_calls(backend: str, t: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    torch._dynamo.reset()
    compiled = torch.compile(_mul_foobar_mul, backend=backend)
    counts, results = [], []
    for _ in range(2):
        before = executions()
        results.append(compiled(t).cpu())
        counts.append(executions() - before)
    return counts, results


@pytest.mark.parametrize("backend", [FUSED, FUSED_STEP])
def test_graph_with_cpu_fallback_op_executes_as_upstream(backend):
    """The probe that finds the fallback op hands its nodes to upstream's partitioner, which would run the graph again."""
    t = torch.randn(7)
    _executions_of_two_calls(UPSTREAM, t.to(device()))  # the first fallback in a process executes once more
    upstream_counts, _ = _executions_of_two_calls(UPSTREAM, t.to(device()))
    with recorded_warnings() as caught:
        ours, results = _executions_of_two_calls(backend, t.to(device()))
    assert ours == upstream_counts, (ours, upstream_counts)
    # openxla_fused_grad runs graphs without a backward as upstream does: nothing unfused to tell.
    said = [m for m in messages_naming(caught, backend) if "CPU fallback): aten::_foobar" in m]
    assert len(said) == (backend == FUSED_STEP), said
    for r in results:
        torch.testing.assert_close(r, _mul_foobar_mul(t))
