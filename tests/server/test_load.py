"""A load run against a real server on the tiny model: chat and completions, streamed
and not, a fifth of the clients leaving at a random point, and a few requests with
poisonous sampling values mixed in. Every other request ends in 200 with the reply it
asked for, the engine lives, its block accounting is intact with no block held, and
the process keeps its memory: RSS after the run within 10% of RSS after a warm-up.

The clients run in a subprocess, so the RSS measured here is the server's (and
pytest's). `scripts/test --slow` also runs the 1,000-request version.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Callable

import httpx
import psutil
import pytest

# argv: url, model, requests, concurrency, poisonous requests, seed. Prints a JSON summary.
CLIENTS = r'''
import asyncio, json, random, sys, time
from collections import Counter
import httpx

url, model = sys.argv[1], sys.argv[2]
total, concurrency, poisonous, seed = map(int, sys.argv[3:7])
POISON = [{"temperature": 1e-300}, {"top_p": 1e-300}, {"repetition_penalty": 1e-300},
          {"temperature": 1e-300, "top_p": 1e-300, "repetition_penalty": 1e-300}]


def plan(i, rng, poison_at):
    chat, stream, max_tokens = rng.random() < 0.6, rng.random() < 0.5, rng.randint(4, 24)
    text = f"Request {i}: " + "word " * rng.randint(1, 60)
    body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    body |= {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    kind = "poisonous" if i in poison_at else "leaves" if rng.random() < 0.2 else "whole"
    if kind == "poisonous":
        body |= POISON[i % len(POISON)]
    leave_at = rng.randint(1, max_tokens) if stream else rng.uniform(0.0, 0.3)  # chunks, or seconds
    return kind, ("/v1/chat/completions" if chat else "/v1/completions"), body, leave_at


async def whole(client, route, body):
    """(status, what is wrong or None)."""
    if body["stream"]:
        async with client.stream("POST", url + route, json=body) as response:
            lines = [line async for line in response.aiter_lines() if line]
        if response.status_code != 200:
            return response.status_code, lines[-1:]
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        ok = lines[-1] == "data: [DONE]" and finish == ["length"]
        return 200, None if ok else lines[-3:]
    response = await client.post(url + route, json=body)
    if response.status_code != 200:
        return response.status_code, response.text[:300]
    reply = response.json()
    ok = reply["usage"]["completion_tokens"] == body["max_tokens"] and reply["choices"][0]["finish_reason"] == "length"
    return 200, None if ok else reply


async def leave(client, route, body, leave_at):
    """Hang up after `leave_at` stream lines, or seconds; the status seen, if any."""
    if body["stream"]:
        async with client.stream("POST", url + route, json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += bool(line)
                if seen >= leave_at:
                    break
            return response.status_code
    try:
        return (await asyncio.wait_for(client.post(url + route, json=body), leave_at)).status_code
    except asyncio.TimeoutError:
        return None


async def one(client, gate, job, results):
    kind, route, body, leave_at = job
    async with gate:
        try:
            if kind == "leaves":
                results[kind].append((await leave(client, route, body, leave_at), None))
            else:
                results[kind].append(await whole(client, route, body))
        except httpx.HTTPError as error:
            results[kind].append((0, f"{type(error).__name__}: {error}"))


async def main():
    rng = random.Random(seed)
    poison_at = set(rng.sample(range(total), poisonous))
    jobs = [plan(i, rng, poison_at) for i in range(total)]
    results = {"whole": [], "leaves": [], "poisonous": []}
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await asyncio.gather(*(one(client, gate, job, results) for job in jobs))
    wall = time.monotonic() - started
    print(json.dumps({
        "wall_s": round(wall, 2), "requests": total,
        "counts": {kind: len(done) for kind, done in results.items()},
        "statuses": {kind: dict(Counter(str(s) for s, _ in done)) for kind, done in results.items()},
        "failures": [(kind, s, detail) for kind, done in results.items() if kind != "leaves"
                     for s, detail in done if s != 200 or detail is not None][:5],
    }))


asyncio.run(main())
'''
MIB = 2**20


def run_clients(url: str, model: str, requests: int, concurrency: int, poisonous: int, seed: int,
                timeout: float) -> dict:
    done = subprocess.run([sys.executable, "-c", CLIENTS, url, model, str(requests), str(concurrency),
                           str(poisonous), str(seed)], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def load_run(make_server: Callable, requests: int, concurrency: int, poisonous: int, warm_up: int,
             timeout: float) -> None:
    live = make_server(engine={"max_num_seqs": 16}, max_queue=64)
    # The same mix first: the batch shapes the kernels cache come up in the first rounds.
    warm = run_clients(live.url, live.model, warm_up, concurrency, poisonous, seed=1, timeout=timeout)
    assert warm["failures"] == [], warm
    live.assert_clean()
    before = rss()
    run = run_clients(live.url, live.model, requests, concurrency, poisonous, seed=2, timeout=timeout)
    healthy = httpx.get(live.url + "/health", timeout=10).status_code
    live.assert_clean()   # idle, check_integrity(), every KV block free
    after = rss()
    print(f"\nload run: {run['requests']} requests at concurrency {concurrency} in {run['wall_s']} s "
          f"({run['counts']}); statuses {run['statuses']}; RSS after warm-up {before / MIB:.0f} MiB, "
          f"after the run {after / MIB:.0f} MiB ({(after - before) / before:+.1%})")
    assert run["failures"] == []
    assert run["counts"]["poisonous"] == poisonous and run["counts"]["leaves"] >= requests // 10
    for kind in ("whole", "poisonous"):
        assert run["statuses"][kind] == {"200": run["counts"][kind]}
    assert healthy == 200
    assert after <= before * 1.10


@pytest.mark.timeout(120)
def test_load_run(make_server):
    load_run(make_server, requests=120, concurrency=16, poisonous=4, warm_up=240, timeout=90)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_load_run_1000_requests(make_server):
    load_run(make_server, requests=1000, concurrency=32, poisonous=10, warm_up=500, timeout=800)
