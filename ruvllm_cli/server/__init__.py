"""An OpenAI-compatible HTTP server (aiohttp) on the shared engine, which also
speaks Anthropic's Messages API.

Layout: `app` (factory, runner helpers), `runner` (aiohttp's runner, answering
protocol errors in our shape), `routes` (handlers), `body` (reading and checking
the JSON body), `protocol` + `fields` + `spec` (request parsing: each field declared
once as a `spec.Field`, which the validator and `openapi` both read; `messages`,
`tool_fields` and `structured` declare theirs), `prompts` (chat template,
tokenizing, per-sequence plans), `bridge` (engine submission and streams),
`responses` (bodies and chunks), `sse`, `metrics`, `middlewares` (errors, CORS,
API key), `state` (per-app state), `models` (the model pool: loading on first use, LRU
and keep-alive unloading; `model_entry` its models and leases, `model_memory` the
release, `model_metrics` its figures), `token_text` (token strings and bytes for
logprobs), `web` (the chat page at /, its files in web/), `messages_api` (Anthropic's
/v1/messages: its fields, blocks, body, events and errors). The server never imports
the CLI.
"""

from ruvllm_cli.server.app import RunningServer, attach_engine, attach_models, create_app, start_server
from ruvllm_cli.server.models import ModelSpec, PoolSettings
from ruvllm_cli.server.state import ServerConfig

__all__ = ["ModelSpec", "PoolSettings", "RunningServer", "ServerConfig", "attach_engine", "attach_models",
           "create_app", "start_server"]
