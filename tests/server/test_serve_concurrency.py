"""Many clients at once: continuous batching through HTTP, and a client that leaves
mid-stream cancels only its own request and frees its blocks."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.timeout(90)

CLIENTS = 16
TOKENS = 32


async def stream_reply(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[str, int, str | None]:
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Story number {i}: once upon a time"}],
        max_tokens=TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    text, usage, finish = "", 0, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage.completion_tokens
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, usage, finish


async def leave_early(client: openai.AsyncOpenAI, model: str, after_chunks: int) -> int:
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A very long story"}], max_tokens=900,
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    seen = 0
    async for _chunk in stream:
        seen += 1
        if seen >= after_chunks:
            break
    await stream.close()   # drops the connection mid-stream
    return seen


def test_concurrent_streams_are_batched_and_a_leaver_cancels_only_itself(server):
    steps_before, generated_before = server.engine(lambda e: (e.stats.steps, e.stats.generated_tokens))
    waits_before = server.state.metrics.registry.get_sample_value("ruvllm_request_queue_time_seconds_count") or 0
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)

    async def main():
        others = [stream_reply(client, server.model, i) for i in range(1, CLIENTS)]
        try:
            return await asyncio.wait_for(asyncio.gather(leave_early(client, server.model, 4), *others), 60)
        finally:
            await client.close()

    left_after, *results = asyncio.run(main())
    assert left_after == 4
    assert all(usage == TOKENS and finish == "length" and text for text, usage, finish in results)
    server.wait_idle()
    steps, generated = server.engine(lambda e: (e.stats.steps - steps_before,
                                                e.stats.generated_tokens - generated_before))
    # One step decodes every running sequence: far fewer steps than tokens.
    total = (CLIENTS - 1) * TOKENS
    assert steps < total / 4, f"{steps} steps for {total} tokens"
    # The leaver stopped long before its 900 tokens.
    assert total < generated < total + 200
    registry = server.state.metrics.registry
    assert registry.get_sample_value("ruvllm_http_requests_total",
                                     {"endpoint": "/v1/chat/completions", "status": "499"}) >= 1
    # Every request's wait in the queue is counted, the leaver's too (it never got a final output).
    assert registry.get_sample_value("ruvllm_request_queue_time_seconds_count") - waits_before == CLIENTS
    server.assert_clean()
    # Each reply is what its prompt yields alone (float32 greedy is batch-invariant).
    alone = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)
    for i in (1, 7, 14):
        reply = alone.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": f"Story number {i}: once upon a time"}],
            max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == results[i - 1][0]


def test_disconnect_of_a_plain_request_cancels_it(server):
    import httpx

    body = {"model": server.model, "messages": [{"role": "user", "content": "Go on"}], "max_tokens": 900,
            "ignore_eos": True}
    generated_before = server.engine(lambda e: e.stats.generated_tokens)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.3)
    server.wait_idle(timeout=10)
    assert server.engine(lambda e: e.stats.generated_tokens) - generated_before < 900
