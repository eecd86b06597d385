import ast
from pathlib import Path

from setuptools import find_packages, setup

PACKAGE = Path(__file__).resolve().parent / "torch_xla_bridge"


def _constants(path: Path) -> dict[str, object]:
    """The module-level literal constants of ``path``, read without importing the package (that needs torch_xla)."""
    consts: dict[str, object] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:  # an f-string or expression: not a plain constant
                pass
    return consts


# The version pins live in torch_xla_bridge/names.py, the package version in its __init__.py.
NAMES = _constants(PACKAGE / "names.py")
VERSION = _constants(PACKAGE / "__init__.py")["__version__"]

setup(
    name="torch_xla_bridge",
    version=VERSION,
    description="openxla_fused_grad: a torch.compile backend for PyTorch/XLA that runs the "
    "backward pass and gradient accumulation as one XLA execution",
    packages=find_packages(include=["torch_xla_bridge", "torch_xla_bridge.*"]),
    python_requires=">=3.10",
    install_requires=[f"torch=={NAMES['TORCH_VERSION']}", f"torch_xla=={NAMES['TORCH_XLA_VERSION']}"],
    extras_require={
        # torchvision, transformers and accelerate: the drop-in examples the tests run.
        # accelerate 1.16.0 (Trainer runs on it): requires torch>=2.0, so it keeps torch 2.9.0.
        # yapf: upstream/make_patch.py formats the pytorch/xla series with upstream's pinned yapf;
        # expecttest: pytorch/xla's test/dynamo/test_bridge.py (upstream/run_upstream_suite.py).
        # pytest-xdist: scripts/test.sh runs the test files in parallel.
        "test": ["pytest", "pytest-xdist==3.8.0", "torchvision==0.24.0", "transformers==4.57.6", "accelerate==1.16.0", "rich==15.0.0",
                 "yapf==0.40.2", "expecttest==0.3.0"],
        # Regenerating upstream/*.patch and running pytorch/xla's own test/dynamo suite against it.
        "upstream": ["yapf==0.40.2", "expecttest==0.3.0", "torchvision==0.24.0"],
        # python -m torch_xla_bridge.explain prints rich tables (plain text without it).
        "explain": ["rich==15.0.0"],
        "bench": ["torchvision==0.24.0", "transformers==4.57.6", "tqdm", "matplotlib"],
        # The documentation site (test/test_docs.py builds it with --strict).
        "docs": ["mkdocs==1.6.1"],
    },
    entry_points={
        "torch_dynamo_backends": [
            f"{NAMES['BACKEND_NAME']} = torch_xla_bridge.backend:openxla_fused_grad",
            f"{NAMES['STEP_BACKEND_NAME']} = torch_xla_bridge.backend:openxla_fused_step",
        ],
    },
)
