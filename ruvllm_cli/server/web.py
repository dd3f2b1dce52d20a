"""The chat page at / (off with --no-web-ui): static files shipped in the package
(server/web/), no CDN and no build step. The page is a client of the API like any
other, so it is served without the API key and holds no secret; every call it makes
carries the key the user typed. Its routes are for a browser, not for programs, and
stay out of /openapi.json (openapi.py)."""

from __future__ import annotations

from importlib import resources
from typing import Awaitable, Callable

from aiohttp import web

# URL path -> (file in server/web/, its content type). Only these files are served:
# no directory is mapped, so nothing else in the package can be reached.
ASSETS: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/ui/style.css": ("style.css", "text/css; charset=utf-8"),
    "/ui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/ui/api.js": ("api.js", "text/javascript; charset=utf-8"),
    "/ui/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
    "/ui/store.js": ("store.js", "text/javascript; charset=utf-8"),
    "/ui/icon.svg": ("icon.svg", "image/svg+xml"),
}
PAGE_PATHS = frozenset(ASSETS)

# Scripts, styles and images from this origin only, nothing inline; the page talks to
# this origin only; no plugin, no frame around it, no form posted elsewhere.
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'", "script-src 'self'", "style-src 'self'", "img-src 'self'", "connect-src 'self'",
    "base-uri 'none'", "form-action 'none'", "frame-ancestors 'none'"])
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    # Links in replies are the model's: the page's address is none of their business.
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",   # frame-ancestors for browsers that predate it
    # Revalidated on each load, so a new ruvllm's page is never mixed with an old script.
    "Cache-Control": "no-cache",
}


def add_web_routes(app: web.Application) -> None:
    """GET / and its assets, read from the package once, when the app is made."""
    for path, (name, content_type) in ASSETS.items():
        app.router.add_get(path, asset_handler(read_asset(name), content_type))


def read_asset(name: str) -> bytes:
    return (resources.files("ruvllm_cli.server") / "web" / name).read_bytes()


def asset_handler(body: bytes, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, headers={"Content-Type": content_type, **SECURITY_HEADERS})

    return handler
