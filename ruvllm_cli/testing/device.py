"""The device engine tests run on: `RUVLLM_TEST_DEVICE=cuda scripts/test tests/engine`
puts the fixtures' engines and their transformers/peft references on a GPU. CI has
none, so the default is the CPU; tests that name "cpu" themselves stay there."""

import os

TEST_DEVICE = os.environ.get("RUVLLM_TEST_DEVICE", "cpu")
