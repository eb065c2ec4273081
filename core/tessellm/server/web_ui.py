"""The built-in web page: GET / (chat and engine dashboard) and its static files (/ui/*).

The files ship inside the package (tessellm/server/static) and are read once per app; only
the names listed in STATIC_FILES are served, so no request path ever reaches the file
system. Every answer carries a Content-Security-Policy that allows scripts, styles and
connections from this origin only (no inline script, no CDN, no framing by another site);
the page itself holds no data and needs no API key — what it fetches (/v1/*, the dashboard's
JSON) does.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

STATIC_FILES = {"index.html": "text/html", "style.css": "text/css",
                **{f"{m}.js": "text/javascript"
                   for m in ("main", "api", "dom", "chat", "dashboard", "charts")}}
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
UI_KEY = web.AppKey("tessellm_ui_files", dict)


def read_static_files() -> dict[str, bytes]:
    folder = resources.files("tessellm.server") / "static"
    return {name: (folder / name).read_bytes() for name in STATIC_FILES}


def _file(name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        body = request.app[UI_KEY][name]
        return web.Response(body=body, headers={
            "Content-Type": f"{STATIC_FILES[name]}; charset=utf-8", **SECURITY_HEADERS})
    return handler


def add_web_ui(app: web.Application) -> None:
    """Routes: / (index.html) and /ui/<name> for every other file of STATIC_FILES."""
    app[UI_KEY] = read_static_files()
    app.router.add_get("/", _file("index.html"))
    for name in STATIC_FILES:
        if name != "index.html":
            app.router.add_get(f"/ui/{name}", _file(name))
