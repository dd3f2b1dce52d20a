"""Issue 18: values the validation admits must never kill the engine (they once made
the softmax NaN: a 500, then every later request failed until a restart)."""

from __future__ import annotations

import pytest
import httpx

POISON = [{"temperature": 1e-40}, {"temperature": 1e-300}, {"temperature": 5e-324}, {"top_p": 1e-300},
          {"repetition_penalty": 1e-300}, {"temperature": 1e-30, "top_p": 1e-300, "min_p": 1.0}]


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
@pytest.mark.parametrize("knobs", POISON, ids=lambda k: ",".join(f"{n}={v}" for n, v in k.items()))
def test_poisonous_sampling_values_answer_200_and_the_engine_lives(server, route, knobs):
    body = {"model": server.model, "max_tokens": 4, **knobs}
    body |= ({"messages": [{"role": "user", "content": "hi"}]} if route == "chat/completions" else {"prompt": "hi"})
    response = httpx.post(f"{server.base_url}/{route}", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
