#!/usr/bin/env python
"""The server's overhead: 16 concurrent streaming HTTP clients against the engine alone.

Same model (Qwen2.5-0.5B shape), same 16 prompts of 256 tokens, 128 new tokens each,
in one process: (a) the engine run directly (LLMEngine.generate), (b) the same work
as 16 concurrent streaming POST /v1/completions on a real socket (127.0.0.1).
Alternating rounds; medians. Prints the aggregate output tok/s of both and the ratio.

    .venv/bin/python scripts/bench_serve.py [--quantization f16] [--rounds 2]
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402

from ruvllm_cli.bench.runner import random_prompts  # noqa: E402
from ruvllm_cli.engine.config import EngineConfig  # noqa: E402
from ruvllm_cli.engine.engine import LLMEngine  # noqa: E402
from ruvllm_cli.engine.loop import EngineLoop  # noqa: E402
from ruvllm_cli.engine.sampling import SamplingParams  # noqa: E402
from ruvllm_cli.quantization import parse_quantization  # noqa: E402
from ruvllm_cli.server import create_app, start_server  # noqa: E402
from ruvllm_cli.bench.harness import script_model, script_parser  # noqa: E402

STREAMS, PROMPT, NEW = 16, 256, 128


def engine_rate(engine: LLMEngine, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    return STREAMS * NEW / (time.perf_counter() - start)


async def http_rate(engine_loop: EngineLoop, prompts: list[list[int]]) -> float:
    server = await start_server(create_app(engine_loop, served_names=["bench"]), "127.0.0.1", 0)
    tokens = 0
    try:
        async with aiohttp.ClientSession() as session:
            async def one(prompt: list[int]) -> None:
                nonlocal tokens
                body = {"model": "bench", "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                async with session.post(server.url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    async for line in response.content:
                        if b'"completion_tokens"' in line:
                            tokens += int(line.split(b'"completion_tokens":')[1].split(b",")[0].strip(b" }"))

            start = time.perf_counter()
            await asyncio.gather(*(one(p) for p in prompts))
            elapsed = time.perf_counter() - start
    finally:
        await server.stop()
    assert tokens == STREAMS * NEW, f"expected {STREAMS * NEW} tokens, the usage chunks said {tokens}"
    return tokens / elapsed


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    quant = parse_quantization(args.quantization)
    model_dir = script_model(args)
    engine = LLMEngine.from_path(str(model_dir), EngineConfig(device="cpu", quantization=quant,
                                                             max_num_seqs=STREAMS))
    vocab = engine.loaded.model.config.vocab_size
    rng = random.Random(0)
    fresh = lambda: random_prompts(range(10, vocab), STREAMS, PROMPT, rng)  # noqa: E731
    engine.generate([fresh()[0][:32]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    engine_loop = EngineLoop(engine)
    direct, http = [], []
    try:
        for _ in range(args.rounds):   # fresh prompts each time: no prefix-cache hits
            direct.append(engine_loop.call(lambda e: engine_rate(e, fresh())))
            http.append(asyncio.run(http_rate(engine_loop, fresh())))
            print(f"round: engine {direct[-1]:.1f} tok/s, HTTP {http[-1]:.1f} tok/s", file=sys.stderr)
    finally:
        engine_loop.shutdown()
    e, h = statistics.median(direct), statistics.median(http)
    print(f"{STREAMS} streams x {PROMPT}-token prompts, {NEW} new tokens, {quant.value}: engine {e:.1f} tok/s, "
          f"HTTP (16 streaming clients) {h:.1f} tok/s, ratio {h / e:.2f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
