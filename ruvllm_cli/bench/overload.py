"""An overload workload against a running server: many long low-priority requests and
a few short high-priority ones sent at once, each streamed, with its time to first
token measured by the client (scripts/bench_priority.py, tests/server).

Imports httpx only (the server's clients need nothing else)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

LOW, HIGH = 1, -1


@dataclass
class Outcome:
    priority: int
    ttft: float | None = None       # seconds from sending to the first content
    total: float | None = None      # seconds from sending to the end of the stream
    tokens: int = 0                 # completion tokens, as the final usage chunk reports them
    error: str | None = None


@dataclass
class OverloadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall: float = 0.0

    def ttfts(self, priority: int) -> list[float]:
        return sorted(o.ttft for o in self.outcomes if o.priority == priority and o.ttft is not None)

    def p95(self, priority: int) -> float:
        values = self.ttfts(priority)
        return values[min(len(values) - 1, int(round(0.95 * (len(values) - 1))))] if values else float("nan")

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None or o.total is None]


async def _one(client, url: str, model: str, priority: int, prompt: str, max_tokens: int) -> Outcome:
    outcome = Outcome(priority)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "priority": priority}
    started = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    outcome.error = chunk["error"]["message"]
                    return outcome
                if chunk.get("usage"):
                    outcome.tokens = chunk["usage"]["completion_tokens"]
                if outcome.ttft is None and any(c.get("text") for c in chunk.get("choices", ())):
                    outcome.ttft = time.perf_counter() - started
        outcome.total = time.perf_counter() - started
    except Exception as error:  # noqa: BLE001 - reported with the outcome
        outcome.error = f"{type(error).__name__}: {error}"
    return outcome


async def run_overload(url: str, model: str, *, low: int = 200, high: int = 50, low_tokens: int = 48,
                       high_tokens: int = 8, prompt: str = "tell me a long story about a lighthouse keeper",
                       timeout: float = 600.0) -> OverloadResult:
    """Send `low` long requests of priority 1, then `high` short ones of priority -1,
    all at once (the low ones first: the worst case for the high ones under fcfs)."""
    import httpx

    limits = httpx.Limits(max_connections=low + high + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        started = time.perf_counter()
        # Each prompt starts with its own number: no request shares another's prefix blocks.
        jobs = [_one(client, url, model, LOW, f"{i} {prompt}", low_tokens) for i in range(low)]
        jobs += [_one(client, url, model, HIGH, f"{low + i} {prompt}", high_tokens) for i in range(high)]
        outcomes = await asyncio.gather(*jobs)
    return OverloadResult(list(outcomes), time.perf_counter() - started)
