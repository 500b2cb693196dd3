"""The script put first in the page's <head> (`app/page_head.py`): the page alone is rewritten, its
length told anew; every other response passes through as it was."""

import asyncio

from specchat.app.page_head import PageHead

PAGE = b"<!doctype html><html><head><script>gradio()</script></head><body></body></html>"


def respond(body_parts, content_type=b"text/html; charset=utf-8", extra=()):
    async def app(scope, receive, send):
        length = sum(map(len, body_parts))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type), (b"content-length", str(length).encode()), *extra]})
        for index, part in enumerate(body_parts):
            await send({"type": "http.response.body", "body": part, "more_body": index < len(body_parts) - 1})
    return app


def fetch(app, path="/", method="GET"):
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request"}

    asyncio.run(PageHead(app, "<script>first()</script>")({"type": "http", "method": method, "path": path},
                                                            receive, send))
    headers = dict(sent[0]["headers"])
    return headers, b"".join(message.get("body", b"") for message in sent[1:])


def test_the_page_gets_the_script_before_its_own_and_its_length_anew():
    headers, body = fetch(respond([PAGE[:20], PAGE[20:]]))  # a body sent in parts is joined first
    assert body == PAGE.replace(b"<head>", b"<head><script>first()</script>")
    assert int(headers[b"content-length"]) == len(body)


def test_everything_else_passes_through_unchanged():
    for app, path, method in ((respond([PAGE]), "/gradio_api/info", "GET"), (respond([PAGE]), "/", "POST"),
                              (respond([b'{"a": 1}'], b"application/json"), "/", "GET"),
                              (respond([b"gzipped"], extra=[(b"content-encoding", b"gzip")]), "/", "GET"),
                              (respond([b"<html>no head</html>"]), "/", "GET")):
        headers, body = fetch(app, path, method)
        assert body in (PAGE, b'{"a": 1}', b"gzipped", b"<html>no head</html>")
        assert int(headers[b"content-length"]) == len(body)
