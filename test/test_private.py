"""The private-API module: bindings fail loudly, and the copied RNG formula matches torch_xla's own."""

from __future__ import annotations

import types

import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch._functorch.aot_autograd import make_boxed_func

from torch_xla_bridge import _private, names


def test_a_missing_private_api_is_an_import_error_naming_the_pinned_releases():
    with pytest.raises(ImportError) as e:
        _private._bind("torch_xla", names.TORCH_XLA_VERSION, "9.9.9", types.SimpleNamespace(), "_XLAC._gone")
    message = str(e.value)
    assert f"torch_xla=={names.TORCH_XLA_VERSION} (found 9.9.9)" in message
    assert "_XLAC._gone is missing" in message
    assert names.TORCH_XLA_INSTALL in message and f"torch=={names.TORCH_VERSION}" in message


@pytest.mark.parametrize("seed", [7, 123456789])
def test_advance_rng_seed_is_what_a_step_barrier_does(seed):
    """The deferred graphs advance the seed per call with the lazy graph executor's formula (copied,
    as upstream's bridge copies it): a step barrier with a random op pending must land on the same seed."""
    device = torch_xla.device()
    xm.set_rng_state(seed, str(device))
    _private.advance_rng_seed(str(device))
    ours = xm.get_rng_state(str(device))
    xm.set_rng_state(seed, str(device))
    drawn = torch.rand(3, device=device)
    torch_xla.sync()
    assert drawn.shape == (3,)
    assert xm.get_rng_state(str(device)) == ours != seed


def test_double_backward_is_recognized_by_aot_autograds_own_function():
    """In a create_graph=True backward AOTAutograd calls the backward graph from its
    CompiledFunctionBackward.forward; a plain backward does not."""
    seen: list[bool] = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def bw_compiler(bw_gm, _):
            def run(*args):
                seen.append(_private.in_aot_double_backward())
                return bw_gm(*args)

            return make_boxed_func(run)

        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g), bw_compiler=bw_compiler)(gm, example_inputs)

    x = torch.randn(4, requires_grad=True)
    f = torch.compile(lambda t: (t.sin() * t).sum(), backend=backend)
    # Donated buffers forbid create_graph=True on the same compiled function.
    with torch._functorch.config.patch(donated_buffer=False):
        f(x).backward()
        (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    assert seen == [False, True]
    assert g.requires_grad


def test_ir_root_reads_the_root_of_the_pending_ir_only():
    dev = torch_xla.device()
    t = torch.randn(3, device=dev)
    xm.mark_step()
    assert _private.ir_root(t) is None  # device data: no pending IR
    u = t + 1
    for _ in range(50):
        u = u * 2
    assert _private.ir_root(u).startswith("aten::mul, xla_shape=f32[3]")
    assert _private.ir_root(torch.zeros(3, device=dev)) == _private.ir_root(t.clone().zero_())
    assert _private.ir_root(torch.zeros(3, device=dev)) != _private.ir_root(torch.zeros(4, device=dev))


def test_take_value_gives_the_destination_the_sources_lazy_tensor():
    dev = torch_xla.device()
    dst, src = torch.zeros(3, device=dev), torch.randn(3, device=dev) * 2
    view = dst[:2]
    _private.take_value(dst, src)
    assert torch_xla._XLAC._xla_get_tensor_id(dst) == torch_xla._XLAC._xla_get_tensor_id(src)
    assert _private.graph_hash([dst]) == _private.graph_hash([src])
    torch.testing.assert_close(view.cpu(), src.cpu()[:2])
