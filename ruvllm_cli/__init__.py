"""ruvllm: download, chat with, serve and benchmark local LLMs."""

__version__ = "0.1.0"
