from setuptools import find_packages, setup

setup(
    name="torch_xla_bridge",
    version="0.1.0",
    description="openxla_fused_grad: a torch.compile backend for PyTorch/XLA that runs the "
    "backward pass and gradient accumulation as one XLA execution",
    packages=find_packages(include=["torch_xla_bridge", "torch_xla_bridge.*"]),
    python_requires=">=3.10",
    install_requires=["torch==2.9.0", "torch_xla==2.9.0"],
    extras_require={
        # torchvision, transformers and accelerate: the drop-in examples the tests run.
        # accelerate 1.16.0 (Trainer runs on it): requires torch>=2.0, so it keeps torch 2.9.0.
        # yapf: upstream/make_patch.py formats the pytorch/xla series with upstream's pinned yapf;
        # expecttest: pytorch/xla's test/dynamo/test_bridge.py (upstream/run_upstream_suite.py).
        "test": ["pytest", "torchvision==0.24.0", "transformers==4.57.6", "accelerate==1.16.0", "rich==15.0.0",
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
            "openxla_fused_grad = torch_xla_bridge.backend:openxla_fused_grad",
            "openxla_fused_step = torch_xla_bridge.backend:openxla_fused_step",
        ],
    },
)
