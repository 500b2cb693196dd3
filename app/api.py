"""The OpenAI-compatible API on the app's server: `GET /v1/models`, `POST /v1/chat/completions`
(streamed as server-sent events or not).

Requests are stateless, as in OpenAI's API: each one resends the conversation, and the engine's
prefix store reuses the KV of what it has already seen, so a follow-up prefills only its new
tokens. The engine answers one request at a time; the others wait in line in worker threads,
each with its own cache and generator, so concurrent clients never share state.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Callable, Iterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..core.engine import Finished, TextDelta
from ..core.errors import InputError, SpecchatError

DEFAULT_MAX_TOKENS = 512
ROLES = ("system", "user", "assistant")
UNSUPPORTED = ("tools", "functions", "logprobs", "response_format")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def add_api(app: FastAPI, get_engine: Callable[[], object], api_key: str | None) -> None:
    """Mount the /v1 routes on `app`; with `api_key`, every request needs `Authorization: Bearer <key>`."""

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not secrets.compare_digest(header.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`", "authentication_error")

    router = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @router.get("/models")
    def models() -> dict:
        engine = get_engine()
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0,
                                            "owned_by": "specchat"}]}

    @router.post("/chat/completions")
    def chat_completions(body: dict):
        engine = get_engine()
        request = _parse(body, engine)
        events = engine.generate(request["prompt_ids"], request["max_tokens"], request["sampling"], "auto")
        first = next(events)  # bad requests raise here, before any response is sent
        if request["stream"]:
            return StreamingResponse(_stream(first, events, engine.name, request["include_usage"]),
                                     media_type="text/event-stream")
        return _complete(first, events, engine.name)

    @app.exception_handler(ApiError)
    def api_error(_request, error: ApiError):
        return _error(error.status, str(error), error.kind)

    @app.exception_handler(SpecchatError)
    def specchat_error(_request, error: SpecchatError):
        status = 400 if isinstance(error, InputError) else 503
        return _error(status, str(error), "invalid_request_error" if status == 400 else "server_error")

    app.include_router(router)


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


def _parse(body: dict, engine) -> dict:
    from ..core.sampling import SamplingParams

    if body.get("model") not in (None, engine.name):
        raise ApiError(404, f"model {body.get('model')!r} is not served here; this server runs {engine.name!r}",
                       "not_found_error")
    for name in UNSUPPORTED:
        if body.get(name):
            raise ApiError(400, f"{name!r} is not supported by specchat")
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n = 1 is supported")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}")
    conversation = [{"role": _role(message), "content": _content(message)} for message in messages]
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ApiError(400, "max_tokens must be a positive integer")
    try:
        sampling = SamplingParams(float(body.get("temperature", 1.0)), 0, float(body.get("top_p", 1.0)),
                                  body.get("seed"))
    except (TypeError, ValueError) as error:
        raise ApiError(400, str(error)) from None
    options = body.get("stream_options") or {}
    return {"prompt_ids": engine.chat_ids(conversation), "max_tokens": max_tokens, "sampling": sampling,
            "stream": bool(body.get("stream")), "include_usage": bool(options.get("include_usage"))}


def _role(message) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    if role == "developer":  # OpenAI's newer name for the system role
        return "system"
    if role not in ROLES:
        raise ApiError(400, f"message role must be one of {', '.join(ROLES)}, got {role!r}")
    return role


def _content(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        return "".join(str(part.get("text", "")) for part in content)
    raise ApiError(400, "message content must be text (a string or a list of text parts)")


def _completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def _usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.new_tokens,
            "total_tokens": result.prompt_tokens + result.new_tokens}


def _finish_reason(result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _complete(first, events: Iterator, model: str) -> dict:
    result = next(event.result for event in _chain(first, events) if isinstance(event, Finished))
    return {"id": _completion_id(), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "finish_reason": _finish_reason(result)}],
            "usage": _usage(result), "specchat": {"mode": result.mode, "stats": result.to_json()["stats"]}}


def _stream(first, events: Iterator, model: str, include_usage: bool) -> Iterator[str]:
    completion_id, created = _completion_id(), int(time.time())

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        return message([{"index": 0, "delta": delta, "finish_reason": finish_reason}])

    def message(choices: list, **extra) -> str:
        payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": choices, **extra}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        for event in _chain(first, events):
            if isinstance(event, TextDelta) and event.text:
                yield chunk({"content": event.text})
            elif isinstance(event, Finished):
                yield chunk({}, _finish_reason(event.result))
                if include_usage:
                    yield message([], usage=_usage(event.result))
        yield "data: [DONE]\n\n"
    except SpecchatError as error:
        yield f"data: {json.dumps({'error': {'message': str(error), 'type': 'server_error'}})}\n\n"
    finally:
        events.close()  # a client that went away releases the engine at once


def _chain(first, events: Iterator) -> Iterator:
    yield first
    yield from events
