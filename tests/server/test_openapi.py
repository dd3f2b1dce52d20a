"""GET /openapi.json: a valid OpenAPI 3.1 document of every route, built from the
same field specs the handlers validate with."""

from __future__ import annotations

import httpx
import pytest
from openapi_spec_validator import validate

from ruvllm_cli.server.messages_api.protocol import MESSAGES_FIELDS
from ruvllm_cli.server.protocol import CHAT_FIELDS, COMPLETION_FIELDS, REQUEST_FIELDS
from ruvllm_cli.server.spec import Field
from ruvllm_cli.server.web import PAGE_PATHS
from ruvllm_cli.testing.api_errors import assert_error

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def request_schema(document, path):
    return document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def test_the_document_is_valid_openapi_and_lists_every_route(server):
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    validate(document)
    assert document["openapi"] == "3.1.0"
    routes = {(route.method, route.resource.canonical) for route in server.thread.app.router.routes()
              if route.method != "HEAD" and route.resource.canonical not in PAGE_PATHS}   # the chat page's files
    assert {(method.upper(), path) for path, item in document["paths"].items() for method in item} == routes
    chat = request_schema(document, "/v1/chat/completions")
    assert list(chat["properties"]) == [field.name for field in CHAT_FIELDS]
    assert chat["required"] == ["model", "messages"]
    assert chat["properties"]["temperature"] == {
        "type": ["number", "null"],
        "description": "0: greedy; higher: more random (default: the model's generation_config.json value, else 1).",
        "minimum": 0.0, "maximum": 2.0}
    assert chat["properties"]["top_p"]["exclusiveMinimum"] == 0.0
    completion = request_schema(document, "/v1/completions")
    assert list(completion["properties"]) == [field.name for field in COMPLETION_FIELDS]
    assert completion["properties"]["logprobs"]["type"] == ["integer", "null"]
    assert "security" not in document["paths"]["/v1/models"]["get"]
    messages = request_schema(document, "/v1/messages")
    assert list(messages["properties"]) == [field.name for field in MESSAGES_FIELDS]
    assert messages["required"] == ["model", "max_tokens", "messages"]
    responses = document["paths"]["/v1/messages"]["post"]["responses"]
    assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/AnthropicError"}
    assert responses["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Message"}


def test_every_documented_bound_is_the_one_the_server_enforces(server):
    """Just past each documented maximum and minimum: a 400 naming the field."""
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    properties = request_schema(document, "/v1/chat/completions")["properties"]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for name, schema in properties.items():
            outside = [schema["maximum"] + 1] if "maximum" in schema else []
            outside += [schema["minimum"] - 1] if "minimum" in schema else []
            outside += [schema["exclusiveMinimum"]] if "exclusiveMinimum" in schema else []
            for value in outside:
                assert_error(http.post("/v1/chat/completions", json={**CHAT, name: value}), 400, name,
                             "invalid_value")


def test_a_field_added_to_the_spec_is_both_validated_and_documented(server, monkeypatch):
    probe = Field("probe", "integer", "A field only this test has.", 1, low=0, high=3)
    monkeypatch.setitem(REQUEST_FIELDS, "/v1/chat/completions", (*CHAT_FIELDS, probe))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert_error(http.post("/v1/chat/completions", json={**CHAT, "probe": 9}), 400, "probe", "invalid_value",
                     "Invalid value for 'probe': must be between 0 and 3 (got 9).")
        assert_error(http.post("/v1/chat/completions", json={**CHAT, "probe": "x"}), 400, "probe", "invalid_type")
        assert http.post("/v1/chat/completions", json={**CHAT, "probe": 2}).status_code == 200
        document = http.get("/openapi.json").json()
    validate(document)
    assert request_schema(document, "/v1/chat/completions")["properties"]["probe"] == {
        "type": ["integer", "null"], "description": "A field only this test has.", "default": 1,
        "minimum": 0, "maximum": 3}


def test_with_an_api_key_the_document_needs_it_and_says_so(make_server):
    live = make_server(api_key="s3cret")
    assert_error(httpx.get(live.url + "/openapi.json", timeout=10), 401, code="invalid_api_key")
    document = httpx.get(live.url + "/openapi.json", headers={"Authorization": "Bearer s3cret"}, timeout=10).json()
    validate(document)
    assert document["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    assert document["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}, {"apiKey": []}]
    assert "401" in document["paths"]["/v1/completions"]["post"]["responses"]
    assert "security" not in document["paths"]["/health"]["get"]   # /health stays open
