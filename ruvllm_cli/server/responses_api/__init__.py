"""OpenAI's Responses API (POST /v1/responses), stateless, on the chat route's path.

A request is read into the chat route's own pieces (`protocol`, `items`): messages
for the chat template (function_call items as an assistant's `tool_calls`,
function_call_output items as `tool` messages), SamplingFields (`text.format` as the
structured output of the chat route), a ToolRequest and RequestOptions.
routes.generate runs it like a chat request, and `events.ResponsesFormat` writes the
Response object and its stream events from the same accumulated choice. Nothing is
stored: a request that needs an earlier response (`previous_response_id`,
`conversation`, an `item_reference`) is a 400. Errors keep OpenAI's shape.
"""
