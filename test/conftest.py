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


# The quick tier (`bash scripts/test.sh -m quick`, README): each stage of the package once, for the
# edit-test loop (about 2 minutes); the whole suite is what CI runs. Node-id prefixes.
QUICK = (
    "test/test_layers.py", "test/test_private.py", "test/test_registration.py", "test/test_host_scalars.py",
    "test/test_execution_counts.py", "test/test_eager_numerics.py", "test/test_autograd_semantics.py",
    "test/test_fallbacks.py", "test/test_first_step.py", "test/test_torch_xla_compile.py", "test/test_spmd.py",
    "test/test_explain_report.py", "test/test_explain.py::test_fused_step_backend_is_one_cut_per_step",
    "test/test_fused_step.py::test_one_execution_per_step",
    "test/test_accumulation.py::test_one_execution_per_step_and_eager_cpu_numerics",
    "test/test_accumulation.py::test_program_holds_one_micro_batch_whatever_k",
    "test/test_out_of_memory.py::test_refused_step_changes_nothing_and_training_goes_on[eager]",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.quick)
