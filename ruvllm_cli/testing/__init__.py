"""Test kit: tiny random-weight models built offline and a fake Hugging Face hub.

Nothing here is imported by the product; tests and `scripts/` use it. Importing this
package is cheap: torch, transformers and tokenizers load only when a model is built.
"""

from ruvllm_cli.testing.fake_hub import FakeHub, RequestRecord
from ruvllm_cli.testing.tiny_model import build_bench_model, build_tiny_model, cached_tiny_model

__all__ = ["FakeHub", "RequestRecord", "build_bench_model", "build_tiny_model", "cached_tiny_model"]
