import os

# Before torch_xla is imported anywhere: the suite runs on PJRT CPU unless told otherwise.
os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest  # noqa: E402
import torch._dynamo  # noqa: E402

import torch_xla  # noqa: E402

import torch_xla_bridge  # noqa: E402,F401

# The autograd engine sizes its per-device queues at the process's first backward pass:
# make the XLA device known before any test runs one on the CPU (test_user_loops'
# eager CPU references), or a later XLA backward trips the engine's device-index assert.
torch_xla.device()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (and never hits dynamo's recompile limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
