"""Tool calls in model replies, one small module per format (hermes, llama3_json,
mistral), each with the same names: NAME, START_MARKERS, scan() and Parser.

`get_parser(name).parse(text)` reads a whole reply; `StreamingToolParser` turns a
stream of decoded text into OpenAI-shaped content and tool-call fragments;
`detect_parser` picks a format from a model's chat template and architecture.
"""

from __future__ import annotations

from ruvllm_cli.engine.tool_parsers import hermes, llama3_json, mistral
from ruvllm_cli.engine.tool_parsers.base import (
    ParsedReply, PartialCall, PartialReply, StreamDelta, ToolCall, ToolCallDelta, ToolParser,
)
from ruvllm_cli.engine.tool_parsers.streaming import StreamingToolParser
from ruvllm_cli.errors import UsageError

__all__ = [
    "PARSERS", "ParsedReply", "PartialCall", "PartialReply", "StreamDelta", "StreamingToolParser",
    "ToolCall", "ToolCallDelta", "ToolParser", "detect_parser", "get_parser",
]

PARSERS: dict[str, type] = {module.NAME: module.Parser for module in (hermes, llama3_json, mistral)}

# Template text that shows a format, in the order checked.
_TEMPLATE_MARKERS = (
    ("<tool_call>", hermes.NAME),
    ("[TOOL_CALLS]", mistral.NAME),
    ("<|python_tag|>", llama3_json.NAME),
)
_ARCHITECTURES = {
    "Qwen2ForCausalLM": hermes.NAME,
    "Qwen2MoeForCausalLM": hermes.NAME,
    "Qwen3ForCausalLM": hermes.NAME,
    "Qwen3MoeForCausalLM": hermes.NAME,
    "MistralForCausalLM": mistral.NAME,
}
_LLAMA3_HEADER = "<|start_header_id|>"


def get_parser(name: str) -> ToolParser:
    """A parser by its name; an unknown name is the user's error."""
    parser_class = PARSERS.get(name)
    if parser_class is None:
        known = ", ".join(sorted(PARSERS))
        raise UsageError(f"unknown tool-call parser {name!r}", hint=f"known parsers: {known}")
    return parser_class()


def detect_parser(chat_template: str | None, architecture: str | None) -> str | None:
    """The tool-call format a model writes, from the markers its chat template
    renders, else from its architecture; None when neither tells."""
    template = chat_template or ""
    for marker, name in _TEMPLATE_MARKERS:
        if marker in template:
            return name
    is_llama3_template = _LLAMA3_HEADER in template
    if is_llama3_template and "ipython" in template:
        return llama3_json.NAME
    if architecture == "LlamaForCausalLM" and is_llama3_template:
        return llama3_json.NAME
    return _ARCHITECTURES.get(architecture or "")
