"""A script put first in the page's <head>, before any of Gradio's own scripts run.

Gradio adds a custom head (`head=`) from its own scripts, after the modules that need the change
have loaded; the page's HTML is the one place that comes before them. This middleware rewrites
only the page itself (GET of `path`, HTML, not compressed) and passes everything else through.
"""

from __future__ import annotations

from typing import Any, Callable

Scope = dict[str, Any]


class PageHead:
    def __init__(self, app: Callable, script: str, path: str = "/"):
        self.app, self.path = app, path
        self.script = script.encode()

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        start: dict | None = None
        body: list[bytes] = []

        async def rewriting(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                if _is_plain_html(message["headers"]):
                    start = message  # held until the whole body is here: its length changes
                    return
            elif message["type"] == "http.response.body" and start is not None:
                body.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                page = _with_script(b"".join(body), self.script)
                headers = [(name, value) for name, value in start["headers"] if name.lower() != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(page)).encode())]})
                await send({"type": "http.response.body", "body": page})
                return
            await send(message)

        await self.app(scope, receive, rewriting)


def _is_plain_html(headers: list[tuple[bytes, bytes]]) -> bool:
    named = {name.lower(): value for name, value in headers}
    return named.get(b"content-type", b"").startswith(b"text/html") and b"content-encoding" not in named


def _with_script(page: bytes, script: bytes) -> bytes:
    """The page with `script` right after its <head> (unchanged if it has none)."""
    at = page.find(b"<head>")
    if at < 0:
        return page
    at += len(b"<head>")
    return page[:at] + script + page[at:]
