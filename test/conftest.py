import os

# Before torch_xla is imported anywhere: the suite runs on PJRT CPU unless told otherwise.
os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest  # noqa: E402
import torch._dynamo  # noqa: E402

import torch_xla_bridge  # noqa: E402,F401


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (and never hits dynamo's recompile limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
