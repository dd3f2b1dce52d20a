"""Chat messages -> prompt token ids through the model's own chat template."""

from __future__ import annotations

from typing import Any, Sequence

from ruvllm_cli.errors import UsageError


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("this model has no chat template", "use a completion prompt instead")
    try:
        ids = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                            add_generation_prompt=add_generation_prompt,
                                            tokenize=True, return_dict=False)
    except Exception as error:  # jinja raises its own types for templates that reject input
        raise UsageError(f"the chat template rejected the messages: {error}") from None
    return [int(i) for i in ids]
