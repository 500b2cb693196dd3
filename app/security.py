"""What every request to the server passes before it reaches the API or the page: a known `Host`
(against DNS rebinding), no cross-site writes, the key when one is set, and bounded bodies.

One pure-ASGI middleware (`Guard`) wraps the whole app, so no route can be forgotten: the /v1
API, Gradio's own HTTP API and queue, its file routes and the page all sit behind it. The only
route it answers itself is the key prompt at /login.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import os
import secrets
import tempfile
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from ..core import limits
from ..core.errors import InputError
from .key_attempts import KeyAttempts
from .uploads import remove_abandoned_parts

LOGIN_PATH = "/login"
UPLOAD_PATH = "/gradio_api/upload"
COOKIE = "specchat_session"
COOKIE_MAX_AGE = 30 * 24 * 3600
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
LOGIN_BODY_BYTES = 4096
# An upload's body is its file plus the multipart framing (boundaries, part headers).
MULTIPART_ALLOWANCE = 64 * 1024


# ---- names ------------------------------------------------------------------------------------


def host_name(value: str) -> str:
    """The name in a `Host` header, an origin's host or a user's --allow-host: lower case, without
    port, brackets or a trailing dot ("[::1]:7860" -> "::1")."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:  # name:port; more colons are a bare IPv6 address
        value = value.split(":")[0]
    return value.rstrip(".")


def allowed_host(value: str) -> str:
    """A --allow-host value as a name, or an `InputError` that says what is expected."""
    value = value.strip()
    name = host_name(value)
    if not name or any(c in value for c in "/ @,") or not all(c.isalnum() or c in ".-_:" for c in name):
        raise InputError(f"--allow-host (or SPECCHAT_ALLOWED_HOSTS) wants a host name such as chat.example.com, "
                         f"got {value!r}")
    return name


def allowed_names(bound: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names the server answers to: loopback, the address it is bound to, and the user's."""
    return frozenset({*LOOPBACK_NAMES, host_name(bound), *(host_name(name) for name in extra)})


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def host_allowed(header: str, names: frozenset[str]) -> bool:
    """An allowed name, or any IP address: DNS rebinding needs a name the attacker controls, so an
    address typed as such (a LAN visitor of a server bound to 0.0.0.0) is safe to answer."""
    name = host_name(header)
    return name in names or _is_ip(name)


def origin_allowed(origin: str, host_header: str, added: frozenset[str]) -> bool:
    """The page's own origin (the request's host and port), or one on a name the user added with
    --allow-host (a proxy may rewrite `Host`). Neither an IP address nor another port of
    localhost is enough: that would let any page served there write here."""
    parsed = urllib.parse.urlsplit(origin)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        return False  # "null" (sandboxed frames, file:// pages) and anything odd
    return parsed.netloc.lower() == host_header.strip().lower() or host_name(parsed.netloc) in added


# ---- the key ----------------------------------------------------------------------------------


def session_token(api_key: str) -> str:
    """The login cookie's value: derived from the key, so the key itself is never stored in a
    browser, and a new key logs every browser out."""
    return hmac.new(api_key.encode(), b"specchat login cookie v1", hashlib.sha256).hexdigest()


def bearer_matches(authorization: str, api_key: str) -> bool:
    scheme, _, token = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


def authorized(headers: Headers, api_key: str) -> bool:
    """`Authorization: Bearer KEY` (any case of the scheme) or the login cookie; constant time."""
    if bearer_matches(headers.get("authorization", ""), api_key):
        return True
    cookie = cookie_parser(headers.get("cookie", "")).get(COOKIE, "")
    return secrets.compare_digest(cookie.encode(), session_token(api_key).encode())


# ---- uploads ----------------------------------------------------------------------------------


def upload_folder() -> Path:
    """Where Gradio stores uploads (gradio.utils.get_upload_folder), symlinks resolved."""
    return Path(os.environ.get("GRADIO_TEMP_DIR") or Path(tempfile.gettempdir()) / "gradio").resolve()


def uploaded_file(path: str | None) -> str | None:
    """`path` when it is a file Gradio received as an upload, else an `InputError`: an event's
    file reference is data the client sends, and may name any file on this machine."""
    if not path:
        return path
    if not Path(path).resolve().is_relative_to(upload_folder()):
        raise InputError(f"refused {Path(path).name}: only files uploaded through this page can be attached")
    return path


# ---- the middleware ---------------------------------------------------------------------------


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    """An error in the OpenAI API's shape, which clients of /v1 expect and the page tolerates."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


def _over_limit(limit: limits.Limit, size: int, what: str) -> str:
    """The limit's own message (it names the limit and its variable) for a `size` over it."""
    try:
        limit.check(size, what)
    except InputError as error:
        return str(error)
    return f"{what} is over the {limit.name} limit"


class _TooLarge(Exception):
    pass


class Guard:
    """The ASGI middleware around the whole server (http and websocket; lifespan passes)."""

    def __init__(self, app, api_key: str | None, bound: str, added: Iterable[str] = (),
                 attempts: KeyAttempts | None = None):
        added = tuple(added)
        self.app, self.api_key = app, api_key
        self.names, self.added = allowed_names(bound, added), frozenset(map(host_name, added))
        self.attempts = attempts or KeyAttempts()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            if refusal.status_code == 401 and _presents_a_key(headers):
                await self.attempts.failed(_client(scope))
            if scope["type"] == "websocket":  # closing before accepting answers the handshake with 403
                return await send({"type": "websocket.close", "code": 1008})
            return await refusal(scope, receive, send)
        if scope["type"] == "http" and self.api_key and scope["path"] == LOGIN_PATH:
            return await self._login(scope, receive, send)
        if scope["type"] == "http":
            return await self._bounded(scope, receive, send, headers)
        return await self.app(scope, receive, send)

    def _refusal(self, scope, headers: Headers) -> Response | None:
        host = headers.get("host", "")
        if not host_allowed(host, self.names):
            return _error(400, f"unknown host {host_name(host)!r}; start specchat with --allow-host "
                               f"{host_name(host) or 'NAME'} to allow it")
        # Browsers send Origin on cross-origin reads too, and Gradio answers those with the origin
        # echoed and credentials allowed: a page on another local port (the same site, so the
        # cookie goes along) could read /config. No other page may read or write here.
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(origin, host, self.added):
            return _error(403, f"refused a request from the web page at {origin}: only this app's own "
                               "page may use it", "permission_error")
        if self.api_key is None or scope["path"] == LOGIN_PATH or authorized(headers, self.api_key):
            return None
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD") and "text/html" in headers.get("accept", ""):
            return RedirectResponse(LOGIN_PATH, 303)
        return _error(401, "missing or wrong API key: send `Authorization: Bearer <key>` "
                           f"(or log in at {LOGIN_PATH})", "authentication_error")

    async def _bounded(self, scope, receive, send, headers: Headers):
        """The app, with its request body bounded: a declared size is checked before anything is
        read, and a body of unknown size (chunked) is counted as it arrives."""
        upload = scope["path"].rstrip("/") == UPLOAD_PATH
        limit, allowance, what = ((limits.UPLOAD, MULTIPART_ALLOWANCE, "this upload") if upload
                                  else (limits.REQUEST_BODY, 0, "this request body"))
        maximum = limit.bytes + allowance

        def too_large(size: int, so_far: bool) -> Response:
            return _error(413, _over_limit(limit, size - allowance, what + (", so far," if so_far else "")))

        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > maximum:
            return await too_large(int(declared), False)(scope, receive, send)

        received, answered, started = 0, False, False

        async def counted_receive():
            nonlocal received, answered
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > maximum:
                    if not started:  # answer now, then end the app's work on this request
                        answered = True
                        await too_large(received, True)(scope, receive, send)
                    raise _TooLarge()
            return message

        async def guarded_send(message):
            nonlocal started
            if answered:  # the 413 has been sent: whatever the app says after it goes nowhere
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except _TooLarge:
            pass
        except Exception:
            if not answered:
                raise
        finally:
            if upload:
                remove_abandoned_parts(upload_folder())

    async def _login(self, scope, receive, send):
        """The key prompt: a form that, given the key, sets the login cookie and goes to the page."""
        if scope["method"] in ("GET", "HEAD"):
            return await HTMLResponse(login_page())(scope, receive, send)
        if scope["method"] != "POST":
            return await _error(405, f"{LOGIN_PATH} takes GET (the form) or POST (the key)")(scope, receive, send)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > LOGIN_BODY_BYTES:
                return await _error(413, "the login form is too large")(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        key = urllib.parse.parse_qs(body.decode("utf-8", "replace")).get("key", [""])[0]
        if not secrets.compare_digest(key.encode(), self.api_key.encode()):
            await self.attempts.failed(_client(scope))
            return await HTMLResponse(login_page("That is not the key: try again."), 401)(scope, receive, send)
        response = RedirectResponse("/", 303)
        response.set_cookie(COOKIE, session_token(self.api_key), max_age=COOKIE_MAX_AGE, path="/",
                            httponly=True, samesite="strict")
        return await response(scope, receive, send)


def _presents_a_key(headers: Headers) -> bool:
    """A guess: a request with a Bearer header or the login cookie (one with neither is not)."""
    return bool(headers.get("authorization")) or COOKIE in cookie_parser(headers.get("cookie", ""))


def _client(scope) -> str:
    return scope["client"][0] if scope.get("client") else "an unknown client"


def login_page(problem: str = "") -> str:
    """A self-contained page (no scripts, no external resources): nothing to load before the key."""
    note = f'<p class="problem">{html.escape(problem)}</p>' if problem else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>specchat: key</title>
<style>
  body {{ font-family: system-ui, sans-serif; display: grid; place-items: center; min-height: 90vh; margin: 0;
         background: #f6f7f9; color: #1f2328; }}
  @media (prefers-color-scheme: dark) {{ body {{ background: #16181c; color: #e6e6e6; }} }}
  form {{ display: grid; gap: .75rem; width: min(22rem, 90vw); }}
  input, button {{ font: inherit; padding: .6rem .7rem; border-radius: .4rem; border: 1px solid #8888; }}
  button {{ background: #f97316; color: white; border: none; cursor: pointer; }}
  .problem {{ color: #d1242f; margin: 0; }}
</style></head>
<body><form method="post" action="{LOGIN_PATH}">
  <h1>specchat</h1>
  <label for="key">This server needs its key (the one given with --api-key or SPECCHAT_API_KEY).</label>
  <input id="key" name="key" type="password" autocomplete="current-password" autofocus required>
  {note}
  <button type="submit">Open the chat</button>
</form></body></html>
"""
