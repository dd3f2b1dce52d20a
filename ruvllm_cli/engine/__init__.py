"""The shared inference engine: continuous batching over a paged KV cache.

Used by chat, serve and benchmark alike; it never imports the CLI or the server.
Heavy imports (torch, transformers) live in the modules that need them, so
`from ruvllm_cli.engine.sampling import SamplingParams` stays light.
"""
