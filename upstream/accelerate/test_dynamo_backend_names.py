# Copyright 2026 The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""TorchDynamoPlugin accepts any backend registered with torch.compile (tests/test_dynamo_backend_names.py)."""

import os
import unittest
from unittest import mock

import torch
from torch._dynamo import register_backend

from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DynamoBackend, TorchDynamoPlugin


CALLS = []


@register_backend(name="accelerate_test_counting_backend")
def counting_backend(gm, example_inputs):
    """A backend registered outside accelerate's enum: records each graph it compiles, runs it eagerly."""
    CALLS.append(len(gm.graph.nodes))
    return gm.forward


class TorchDynamoBackendNamesTester(unittest.TestCase):
    def setUp(self):
        AcceleratorState._reset_state(True)
        CALLS.clear()

    def tearDown(self):
        AcceleratorState._reset_state(True)
        torch._dynamo.reset()

    def test_enum_names_are_unchanged(self):
        for name in ("inductor", "INDUCTOR", "no", DynamoBackend.EAGER):
            plugin = TorchDynamoPlugin(backend=name)
            self.assertIsInstance(plugin.backend, DynamoBackend)
        self.assertEqual(TorchDynamoPlugin(backend="inductor").to_kwargs()["backend"], "inductor")
        self.assertEqual(TorchDynamoPlugin().backend, DynamoBackend.NO)

    def test_registered_backend_is_accepted_by_name(self):
        plugin = TorchDynamoPlugin(backend="accelerate_test_counting_backend")
        self.assertEqual(plugin.backend, "accelerate_test_counting_backend")
        self.assertNotEqual(plugin.backend, DynamoBackend.NO)
        self.assertEqual(plugin.to_dict()["backend"], "accelerate_test_counting_backend")
        self.assertEqual(plugin.to_kwargs(), {"backend": "accelerate_test_counting_backend"})

    def test_registered_backend_from_environment(self):
        # The variable TrainingArguments(torch_compile_backend=...) sets for the Trainer's Accelerator.
        with mock.patch.dict(os.environ, {"ACCELERATE_DYNAMO_BACKEND": "accelerate_test_counting_backend"}):
            plugin = TorchDynamoPlugin()
        self.assertEqual(plugin.backend, "accelerate_test_counting_backend")

    def test_torch_xla_backend_name(self):
        # torch registers "openxla" (torch/_dynamo/backends/torchxla.py; torch_xla runs it); the enum never had it.
        self.assertIn("openxla", torch._dynamo.list_backends(exclude_tags=()))
        self.assertEqual(TorchDynamoPlugin(backend="openxla").to_kwargs(), {"backend": "openxla"})

    def test_unknown_backend_is_an_error(self):
        with self.assertRaisesRegex(ValueError, "not a valid dynamo backend.*registered with torch.compile"):
            TorchDynamoPlugin(backend="no_such_backend")

    def test_prepare_compiles_with_the_registered_backend(self):
        accelerator = Accelerator(dynamo_backend="accelerate_test_counting_backend")
        model = accelerator.prepare(torch.nn.Linear(4, 2))
        for _ in range(2):
            model(torch.randn(3, 4, device=accelerator.device))
        self.assertEqual(len(CALLS), 1)  # compiled once by our backend, then cached


if __name__ == "__main__":
    unittest.main()
