"""Chat messages -> prompt token ids through the model's own chat template."""

from __future__ import annotations

from typing import Any, Sequence

from ruvllm_cli.errors import UsageError


# What the template's caller sets itself: not for `template_kwargs` to override.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "return_dict", "chat_template"})


def render_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Sequence[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template.

    An assistant message with calls and no content gets "" (vLLM's reading): Qwen3's
    template tests `'</think>' in message.content`, which a missing content fails.
    `template_kwargs` are the template's own variables (vLLM's `chat_template_kwargs`:
    Qwen3's `enable_thinking`, ...)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("this model has no chat template", "use a completion prompt instead")
    conversation = [{**m, "content": ""} if m.get("role") == "assistant" and m.get("content") is None else m
                    for m in messages]
    try:
        ids = tokenizer.apply_chat_template(conversation, tools=list(tools) if tools else None,
                                            add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message,
                                            tokenize=True, return_dict=False, **(template_kwargs or {}))
    except Exception as error:  # jinja raises its own types for templates that reject input
        raise UsageError(f"the chat template rejected the messages: {error}") from None
    return [int(i) for i in ids]
