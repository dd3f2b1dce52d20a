"""LangChain's ChatOpenAI, unchanged, against the server (no client-side token
counting: that would make tiktoken fetch its encodings from the internet)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def llm(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=server.model, base_url=server.base_url, api_key="unused", max_tokens=12,
                      temperature=0, max_retries=0, timeout=30)


def test_invoke_returns_a_message(llm):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    reply = llm.invoke([SystemMessage("Be brief."), HumanMessage("Hello there")])
    assert isinstance(reply, AIMessage)
    assert isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata["output_tokens"] <= 12


def test_stream_yields_the_same_text(llm):
    whole = llm.invoke("Tell me about tea").content
    chunks = list(llm.stream("Tell me about tea"))
    assert len(chunks) > 1
    assert "".join(chunk.content for chunk in chunks) == whole
