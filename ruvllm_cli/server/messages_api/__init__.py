"""Anthropic's Messages API (POST /v1/messages) on the chat route's path.

A request is read into the chat route's own pieces (`protocol`, `blocks`): messages
for the chat template with tool calls and results in OpenAI's form, SamplingFields,
a ToolRequest and RequestOptions. routes.generate runs it like a chat request
(prefix cache, batching, tool grammars, LoRA adapters as models), and
`responses.MessagesFormat` writes Anthropic's body and stream events from the same
accumulated choices. Errors on the route take Anthropic's shape (`errors`).
"""
