"""The drop-in examples train identically under `openxla` and `openxla_fused_grad`."""

import importlib.util
from pathlib import Path

import pytest
import torch._dynamo

from xla_helpers import FUSED, UPSTREAM

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("example", ["train_resnet", "train_causal_lm"])
def test_example_losses_match_upstream(example):
    main = load(example).main
    losses = {}
    for backend in (FUSED, UPSTREAM):
        torch._dynamo.reset()
        losses[backend] = main(["--backend", backend, "--steps", "3"])
    assert losses[FUSED] == pytest.approx(losses[UPSTREAM], rel=1e-5, abs=1e-6)
