"""The chat page's files over HTTP: what is served, with which headers, without the
API key, and not at all with --no-web-ui (the page itself: test_web_chat.py)."""

from __future__ import annotations

import re
from importlib import resources

import httpx
import pytest

from ruvllm_cli.server.web import ASSETS, CONTENT_SECURITY_POLICY

pytestmark = pytest.mark.timeout(60)
WEB_DIR = resources.files("ruvllm_cli.server") / "web"


def test_every_file_is_served_with_its_type_and_the_security_headers(server):
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for path, (name, content_type) in ASSETS.items():
            response = http.get(path)
            assert response.status_code == 200, path
            assert response.content == (WEB_DIR / name).read_bytes()
            assert response.headers["Content-Type"] == content_type
            assert response.headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
            assert response.headers["X-Content-Type-Options"] == "nosniff"
            assert response.headers["Referrer-Policy"] == "no-referrer"
            assert response.headers["Cache-Control"] == "no-cache"
        assert http.head("/").status_code == 200
        for path in ("/ui/", "/ui/index.html", "/index.html", "/ui/web.py"):   # the listed files only
            assert http.get(path).status_code == 404, path


def test_the_policy_admits_this_origin_only_and_nothing_inline():
    directives = dict(d.split(" ", 1) for d in CONTENT_SECURITY_POLICY.split("; "))
    assert directives["default-src"] == "'none'"
    assert {directives[name] for name in ("script-src", "style-src", "connect-src", "img-src")} == {"'self'"}
    assert directives["frame-ancestors"] == "'none'" and directives["base-uri"] == "'none'"


def test_the_page_loads_only_its_own_files():
    """No inline script or style, no remote origin: the policy could not be kept otherwise."""
    html = (WEB_DIR / "index.html").read_text()
    assert re.findall(r"<script\b[^>]*>", html) == ['<script type="module" src="ui/app.js">']
    assert "<style" not in html and " style=" not in html
    assert re.findall(r'(?:src|href)="([^"]+)"', html) == ["ui/icon.svg", "ui/style.css", "ui/app.js"]
    shipped = {p.name for p in WEB_DIR.iterdir() if not p.name.startswith(".")}
    assert shipped == {name for name, _ in ASSETS.values()}   # every file served, none missing
    for name in shipped - {"index.html"}:
        text = (WEB_DIR / name).read_text()
        assert not re.search(r"""(?:from|import\(|src=|href=|url\()\s*['"]?(?:https?:)?//""", text), name
        # Text never becomes markup or code: no HTML parsing, no eval.
        assert not re.search(r"\.(?:inner|outer)HTML\s*=|insertAdjacentHTML|document\.write|\beval\(|new Function",
                             text), name


def test_with_an_api_key_only_the_page_is_public(make_server):
    live = make_server(api_key="s3cret")
    with httpx.Client(base_url=live.url, timeout=10) as http:
        for path in ASSETS:
            response = http.get(path)
            assert response.status_code == 200, path
            assert b"s3cret" not in response.content
        for path in ("/v1/models", "/metrics", "/openapi.json", "/v1/nothing", "/ui/nothing"):
            assert http.get(path).status_code == 401, path
        assert http.post("/v1/chat/completions", json={}).status_code == 401


def test_no_web_ui_serves_no_page(make_server):
    live = make_server(web_ui=False)
    with httpx.Client(base_url=live.url, timeout=10) as http:
        for path in ASSETS:
            assert http.get(path).status_code == 404, path
        assert http.get("/v1/models").status_code == 200


def test_the_api_document_leaves_the_page_out(server):
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    assert not set(document["paths"]) & set(ASSETS)
    assert "/v1/chat/completions" in document["paths"]
