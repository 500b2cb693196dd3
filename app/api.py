"""The OpenAI-compatible API on the app's server: `GET /v1/models`, `POST /v1/chat/completions`
(streamed as server-sent events or not).

Requests are stateless, as in OpenAI's API: each one resends the conversation, and the engine's
prefix store reuses the KV of what it has already seen, so a follow-up prefills only its new
tokens. Every answer is a job in the engine's line (`engine_queue`), tokenized and generated on
the engine thread; the routes are coroutines, so a request waiting in line holds no thread, and a
client that goes away (waiting, streaming or not) cancels its job at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Iterator

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..core.engine import Finished, TextDelta
from ..core.errors import InputError, SpecchatError
from ..core.request import Request as AnswerRequest  # fastapi's Request is the HTTP one
from ..core.sampling import MAX_COUNT_PENALTY, MAX_REPETITION_PENALTY, SamplingParams
from .documents import has_unpaired_surrogate
from .engine_handle import EngineHandle
from .engine_queue import Busy
from .stop_text import StopText
from .token_bound import check_fits

DEFAULT_MAX_TOKENS = 512
MAX_STOPS = 4
RETRY_AFTER_SECONDS = 5
ROLES = ("system", "user", "assistant")
# Refused when given (not empty): silently ignored, the answer would not be the one asked for.
UNSUPPORTED = ("tools", "functions", "logprobs", "top_logprobs", "response_format", "logit_bias")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


@dataclass(frozen=True)
class Options:
    conversation: list[dict]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    stream: bool
    include_usage: bool


def add_api(app: FastAPI, handle: EngineHandle) -> None:
    """Mount the /v1 routes on `app` (authentication, when wanted, is the app's middleware)."""
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> dict:
        engine = await _engine(handle)
        return {"object": "list", "data": [_model(engine.name)]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        engine = await _engine(handle)
        if model_id != engine.name:
            raise ApiError(404, f"model {model_id!r} is not served here; this server runs {engine.name!r}",
                           "not_found_error", "model")
        return _model(engine.name)

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        body = _json_object(await request.body())
        engine = await _engine(handle)
        options = _parse(body, engine.name)
        ticket = handle.submit(_job(options))
        events = ticket.__aiter__()
        gone = asyncio.ensure_future(_disconnected(request))
        streaming = False
        try:
            if options.stream:
                first = await _unless_gone(anext(events), gone)  # a bad request raises here: a 400, no byte sent
                streaming = True
                return StreamingResponse(_stream(first, events, ticket, engine.name, options.include_usage),
                                         media_type="text/event-stream")
            return _completion(await _unless_gone(_result(events), gone), engine.name)
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        finally:
            gone.cancel()
            if not streaming:
                ticket.close()  # a no-op once the answer is complete

    # Last: any other path or method under /v1 would reach the page's app (Gradio), whose 404 is
    # not in the API's error shape.
    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def elsewhere(path: str, request: Request):
        methods = {"models": "GET", "chat/completions": "POST"}
        if path.strip("/") in methods:
            raise ApiError(405, f"{request.method} is not allowed on /v1/{path.strip('/')}: use "
                                f"{methods[path.strip('/')]}", headers={"Allow": methods[path.strip("/")]})
        raise ApiError(404, f"there is no /v1/{path}: this server answers GET /v1/models and POST "
                            "/v1/chat/completions", "not_found_error")

    @app.exception_handler(ApiError)
    def api_error(_request, error: ApiError):
        return _error(error.status, str(error), error.kind, error.param, error.headers)

    @app.exception_handler(SpecchatError)
    def specchat_error(_request, error: SpecchatError):
        if isinstance(error, Busy):
            return _error(503, str(error), "server_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        status = 400 if isinstance(error, InputError) else 503
        return _error(status, str(error), "invalid_request_error" if status == 400 else "server_error")

    app.include_router(router)


async def _engine(handle: EngineHandle):
    """The engine, for its name; a model still loading is waited for off the event loop."""
    if handle.status() == "loading":
        return await anyio.to_thread.run_sync(handle.get)
    return handle.get()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(awaitable, gone: asyncio.Future):
    """`awaitable`'s result, or `ClientGone` (the awaitable cancelled) if the client leaves first."""
    step = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not step.done():
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await step
    if step.cancelled():
        raise ClientGone()
    return step.result()


def _job(options: Options):
    """The answer as a job for the engine thread: tokenizing included, off the event loop. A prompt
    whose length alone shows it past the context is refused before it is tokenized."""
    def job(engine, cancel) -> Iterator:
        check_fits(engine, options.conversation)
        prompt_ids = engine.chat_ids(options.conversation)
        events = engine.generate(prompt_ids, AnswerRequest(options.max_tokens, options.sampling), cancel)
        return _until_stop(events, StopText(options.stops), cancel) if options.stops else events
    return job


def _until_stop(events: Iterator, stop: StopText, cancel) -> Iterator:
    """The events with the text cut before the first stop string; generation is cancelled
    once one is seen, and the answer then ends with finish_reason "stop", its tokens those
    written until the stop string was complete: a speculative step commits several tokens at
    once, and those past it would make the usage depend on the mode."""
    written, starts = "", []  # the answer's text as written, and where each token's text starts
    for event in events:
        if isinstance(event, TextDelta):
            for (text, _), _ in zip(event.pieces, event.token_ids):
                starts.append(len(written))
                written += text
            shown = stop.feed(event.text)
            if stop.matched:
                cancel.set()
            if shown:
                yield replace(event, text=shown)
        elif isinstance(event, Finished):
            tail = stop.finish()
            if tail:
                yield TextDelta(tail, [], event.result.stats)
            result = replace(event.result, text=stop.text)
            if stop.matched:
                end = stop.end_in(written)
                kept = sum(start < end for start in starts) if len(starts) == len(result.token_ids) else None
                result = replace(result, finish_reason="stop", **({} if kept is None else {
                    "token_ids": result.token_ids[:kept], "new_tokens": kept}))
            yield Finished(result)
        else:
            yield event


# --- the request ------------------------------------------------------------------------------

def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _parse(body: dict, model: str) -> Options:
    if body.get("model") not in (None, model):
        raise ApiError(404, f"model {body.get('model')!r} is not served here; this server runs {model!r}",
                       "not_found_error", "model")
    for name in UNSUPPORTED:
        if body.get(name):
            raise ApiError(400, f"{name!r} is not supported by specchat", param=name)
    if not (_is_integer(body.get("n", 1)) and body.get("n", 1) == 1):  # `true` is no count
        raise ApiError(400, "only n = 1 is supported", param="n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", param="messages")
    conversation = [{"role": _role(message), "content": _content(message)} for message in messages]
    if body.get("tool_choice") not in (None, "none", "auto"):  # a call asked for, which no tool can make
        raise ApiError(400, "tool calls are not supported by specchat: leave tool_choice out, or 'none'",
                       param="tool_choice")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:  # only the most likely token is kept (OpenAI's and llama.cpp's reading): greedy
        temperature, top_p = 0.0, 1.0
    seed = body.get("seed")
    if seed is not None and not _is_integer(seed):
        raise ApiError(400, f"seed must be a whole number, got {seed!r}", param="seed")
    # OpenAI's ranges; repetition_penalty (vLLM's and llama.cpp's extension) up to the core's cap.
    penalties = dict(repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY,
                                                open_low=True),
                     frequency_penalty=_number(body, "frequency_penalty", 0.0, -MAX_COUNT_PENALTY, MAX_COUNT_PENALTY),
                     presence_penalty=_number(body, "presence_penalty", 0.0, -MAX_COUNT_PENALTY, MAX_COUNT_PENALTY))
    try:
        sampling = SamplingParams(temperature, 0, top_p, seed, **penalties)
    except ValueError as error:
        raise ApiError(400, str(error), param="seed") from None
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, f"stream_options must be an object, got {options!r}", param="stream_options")
    return Options(conversation, _max_tokens(body), sampling, _stops(body.get("stop")), bool(stream),
                   bool((options or {}).get("include_usage")))


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    # In range before isfinite: an integer too large for a float raised OverflowError there (a 500).
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (low < value if open_low else low <= value) or value > high or not math.isfinite(value):
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        shown = repr(value) if not isinstance(value, int) or abs(value) < 10 ** 30 else "a number of {} digits".format(
            len(str(abs(value))))
        raise ApiError(400, f"{name} must be a number in {interval}, got {shown}", param=name)
    return float(value)


def _max_tokens(body: dict) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not _is_integer(value) or value < 1:
        raise ApiError(400, f"{name} must be a whole number of at least 1, got {value!r}", param=name)
    return value


def _stops(stop) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS \
            or not all(isinstance(item, str) and item for item in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them, "
                            f"got {stop!r}", param="stop")
    return stops


def _role(message) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    if role == "developer":  # OpenAI's newer name for the system role
        return "system"
    if role not in ROLES:
        raise ApiError(400, f"message role must be one of {', '.join(ROLES)}, got {role!r}", param="messages")
    return role


def _content(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        raise ApiError(400, "message content must be text (a string or a list of text parts)", param="messages")
    if has_unpaired_surrogate(content):  # JSON's "\ud83d" alone: no character, and no tokenizer takes it
        raise ApiError(400, "message content holds an unpaired surrogate (half a UTF-16 pair, such as \\ud83d "
                            "alone): send valid Unicode text", param="messages")
    return content


# --- the response -----------------------------------------------------------------------------

def _error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status,
                        headers=headers)


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "specchat"}


def _completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def _usage(result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.new_tokens,
            "total_tokens": result.prompt_tokens + result.new_tokens}


def _finish_reason(result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


async def _result(events: AsyncIterator):
    async for event in events:
        if isinstance(event, Finished):
            return event.result
    raise SpecchatError("the answer was cancelled before it started")


def _completion(result, model: str) -> dict:
    return {"id": _completion_id(), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "finish_reason": _finish_reason(result)}],
            "usage": _usage(result), "specchat": {"mode": result.mode, "stats": result.to_json()["stats"]}}


async def _stream(first, events: AsyncIterator, ticket, model: str, include_usage: bool) -> AsyncIterator[str]:
    completion_id, created = _completion_id(), int(time.time())

    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        return message([{"index": 0, "delta": delta, "finish_reason": finish_reason}])

    def message(choices: list, **extra) -> str:
        payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": choices, **extra}
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in _chain(first, events):
            if isinstance(event, TextDelta) and event.text:
                yield chunk({"content": event.text})
            elif isinstance(event, Finished):
                yield chunk({}, _finish_reason(event.result))
                if include_usage:
                    yield message([], usage=_usage(event.result))
        yield "data: [DONE]\n\n"
    except Exception as error:  # the headers are sent: the error goes in the stream, in one line
        text = str(error) if isinstance(error, SpecchatError) else f"unexpected error: {type(error).__name__}: {error}"
        payload = {"error": {"message": text, "type": "server_error", "param": None, "code": None}}
        yield f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
    finally:
        ticket.close()  # a client that went away (Starlette cancels this task) frees the engine now


async def _chain(first, events: AsyncIterator) -> AsyncIterator:
    yield first
    async for event in events:
        yield event
