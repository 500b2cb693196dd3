"""The OpenAI-compatible API over real HTTP, driven by the `openai` Python client and by raw
requests: models, answers streamed and not, follow-ups that reuse the KV, stop strings, errors in
OpenAI's shape for every malformed field, a full line answered 503, and a burst of 16 concurrent
streams that must come back as 16 correct, separate answers while the page stays up.
(The API key is the app's middleware, tested with it.)"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from api_server import serving_api
from conftest import DATA, holding

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
KEY = "test-key-123"
MODEL = "embedded/SmolLM2-135M-Instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(embedded_engine):
    with serving_api(embedded_engine) as (url, _handle):
        yield f"{url}/"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}v1", api_key=KEY, max_retries=0, timeout=300)


def ask(client, question: str, max_tokens: int = 12, history: list | None = None, **kwargs):
    messages = (history or []) + [{"role": "user", "content": question}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          temperature=0, **kwargs)


def streamed_text(client, question: str, max_tokens: int = 12) -> str:
    stream = ask(client, question, max_tokens, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_models_and_an_answer(client):
    assert [model.id for model in client.models.list()] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
    completion = ask(client, "What is the capital of France?", 24)
    assert "Paris" in completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens > 0 and completion.usage.prompt_tokens > 10


def test_streamed_answer_equals_the_whole_answer(client):
    question = "Name three colors of the rainbow."
    assert streamed_text(client, question) == ask(client, question).choices[0].message.content


def test_a_follow_up_reuses_the_conversation(client):
    first = ask(client, "Write one sentence about the sea.", 16)
    history = [{"role": "user", "content": "Write one sentence about the sea."},
               {"role": "assistant", "content": first.choices[0].message.content}]
    follow_up = ask(client, "Now one about the sky.", 16, history=history)
    stats = follow_up.model_dump()["specchat"]["stats"]
    assert stats["reused_from"] == "memory" and stats["reused_prompt_tokens"] >= first.usage.prompt_tokens


def test_errors_are_openai_errors(client, server):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="reads at most"):
        ask(client, "word " * 9000)


def test_sixteen_concurrent_streams_come_back_correct_and_separate(client, server):
    questions = [f"What is {n} plus {n}? Answer with the number." for n in range(1, 17)]
    page_times = []
    with ThreadPoolExecutor(16) as pool:
        burst = [pool.submit(streamed_text, client, question) for question in questions]
        while not all(future.done() for future in burst):  # the page keeps answering meanwhile
            started = time.monotonic()
            assert urllib.request.urlopen(server, timeout=30).status == 200
            page_times.append(time.monotonic() - started)
            time.sleep(1)
        answers = [future.result() for future in burst]
    alone = [ask(client, question).choices[0].message.content for question in questions]
    assert answers == alone  # each stream got its own answer, exactly as when asked alone
    assert len(set(answers)) > 8  # and they are different answers
    assert page_times and max(page_times) < 5


def post(server: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server}v1/chat/completions", content=content, timeout=120,
                      headers={"content-type": "application/json"}, **kwargs)


def refused(response: httpx.Response, status: int = 400) -> dict:
    """The error of a refused request, checked to be in OpenAI's shape."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def sse_text(response: httpx.Response) -> tuple[str, list[dict]]:
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert response.text.rstrip().endswith("data: [DONE]")
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]), chunks


@pytest.mark.parametrize("body, param, words", [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    ({"messages": FRANCE, "temperature": 2.5}, "temperature", "in [0, 2]"),
    ({"messages": FRANCE, "temperature": -0.1}, "temperature", "in [0, 2]"),
    ({"messages": FRANCE, "temperature": "hot"}, "temperature", "a number"),
    ({"messages": FRANCE, "temperature": True}, "temperature", "a number"),
    ({"messages": FRANCE, "top_p": -0.1}, "top_p", "in [0, 1]"),
    ({"messages": FRANCE, "top_p": 1.5}, "top_p", "in [0, 1]"),
    ({"messages": FRANCE, "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"messages": FRANCE, "max_tokens": -3}, "max_tokens", "at least 1"),
    ({"messages": FRANCE, "max_tokens": 1.5}, "max_tokens", "whole number"),
    ({"messages": FRANCE, "max_tokens": True}, "max_tokens", "whole number"),
    ({"messages": FRANCE, "max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ({"messages": FRANCE, "seed": 1.5}, "seed", "whole number"),
    ({"messages": FRANCE, "seed": True}, "seed", "whole number"),
    ({"messages": FRANCE, "seed": -1}, "seed", "between 0"),
    ({"messages": FRANCE, "stream": True, "stream_options": "usage"}, "stream_options", "an object"),
    ({"messages": FRANCE, "stream_options": [1]}, "stream_options", "an object"),
    ({"messages": FRANCE, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"messages": FRANCE, "stop": 3}, "stop", "non-empty string"),
    ({"messages": FRANCE, "stop": [""]}, "stop", "non-empty string"),
    ({"messages": FRANCE, "n": 2}, "n", "n = 1"),
    ({"messages": FRANCE, "n": True}, "n", "n = 1"),
    ({"messages": FRANCE, "logit_bias": {"42": 100}}, "logit_bias", "not supported"),
    ({"messages": FRANCE, "tool_choice": "required"}, "tool_choice", "not supported"),
    ({"messages": FRANCE, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "not supported"),
    (b'{"messages": [{"role": "user", "content": "half \\ud83d an emoji"}]}', "messages", "unpaired surrogate"),
    # An integer too large for a float: OverflowError in isfinite was a bare 500.
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1' + b"9" * 400 + b"}", "temperature",
     "a number of 401 digits"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -1' + b"9" * 400 + b"}",
     "presence_penalty", "in [-2, 2]"),
])
def test_malformed_requests_are_400s_in_openai_shape(server, body, param, words):
    error = refused(post(server, body))
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"
    streamed = refused(post(server, {**body, "stream": True} if isinstance(body, dict) else body))
    assert streamed == error or param == "stream_options"


@pytest.mark.parametrize("method, path, status", [
    ("GET", "v1/chat/completions", 405), ("OPTIONS", "v1/chat/completions", 405), ("POST", "v1/models", 405),
    ("GET", "v1/completions", 404), ("POST", "v1/embeddings", 404), ("GET", "v1/models/gpt-4", 404)])
def test_other_paths_and_methods_under_v1_answer_in_the_apis_shape(server, method, path, status):
    """Gradio, mounted at /, answered them {"detail": "Not Found"}."""
    error = refused(httpx.request(method, f"{server}{path}", timeout=60), status)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_any_temperature_above_zero_works_even_a_tiny_one(server):
    seeded = {"messages": FRANCE, "max_tokens": 8, "temperature": 1e-300, "seed": 3}
    greedy = post(server, {**seeded, "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert post(server, seeded).json()["choices"][0]["message"]["content"] == greedy
    text, _ = sse_text(post(server, {**seeded, "stream": True}))
    assert text == greedy


def test_top_p_zero_keeps_only_the_most_likely_token(server):
    # OpenAI and llama.cpp take top_p 0 (it was refused as outside (0, 1]); tool_choice none or auto asks nothing.
    body = {"messages": FRANCE, "max_tokens": 8, "temperature": 1.5, "seed": 3}
    greedy = post(server, {**body, "temperature": 0}).json()["choices"][0]["message"]["content"]
    answer = post(server, {**body, "top_p": 0, "tool_choice": "none"}).json()["choices"][0]["message"]["content"]
    assert answer == greedy != post(server, body).json()["choices"][0]["message"]["content"]


def test_absent_or_null_limits_take_their_defaults(server):
    answer = post(server, {"messages": FRANCE, "max_tokens": None, "max_completion_tokens": 3, "seed": None,
                           "stream_options": None, "stop": None, "temperature": None, "top_p": None}).json()
    assert answer["usage"]["completion_tokens"] == 3 and answer["choices"][0]["finish_reason"] == "length"


def test_stop_strings_end_the_answer_before_them(server):
    whole = post(server, {"messages": FRANCE, "max_tokens": 24, "temperature": 0}).json()
    whole = whole["choices"][0]["message"]["content"]
    assert "Paris" in whole
    for stop, first in ((" Paris", " Paris"), (["nothing like this", "aris"], "aris")):
        body = {"messages": FRANCE, "max_tokens": 24, "temperature": 0, "stop": stop}
        answer = post(server, body).json()
        content = answer["choices"][0]["message"]["content"]
        assert content == whole.split(first)[0] and answer["choices"][0]["finish_reason"] == "stop"
        text, chunks = sse_text(post(server, {**body, "stream": True}))
        # What was streamed is exactly the cut answer: no piece of the stop string went out.
        assert text == content and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_full_line_is_a_503_with_the_count(embedded_engine):
    with serving_api(embedded_engine, max_waiting=1) as (url, handle):
        gate, held = holding(handle)
        waiting = handle.submit(lambda engine, cancel: iter(["waited"]))  # the line (of one) is full now
        try:
            response = post(f"{url}/", {"messages": FRANCE, "max_tokens": 2})
            error = refused(response, 503)
            assert error["message"] == "busy: 1 requests waiting, try again shortly" and error["type"] == "server_error"
            assert int(response.headers["retry-after"]) > 0
        finally:
            gate.set()
            assert list(held) == ["held"] and list(waiting) == ["waited"]


def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenized(server, embedded_engine, monkeypatch):
    # Found: a 7.8 MB prompt was tokenized whole on the engine thread (7.6 s, +0.7 GB) before its 400.
    tokenized = []
    monkeypatch.setattr(embedded_engine, "chat_ids", lambda messages: tokenized.append(messages) or [])
    for stream in (False, True):
        response = post(server, {"messages": [{"role": "user", "content": "word " * 400_000}], "stream": stream})
        error = refused(response)
        assert "the prompt is at least 24,694 tokens" in error["message"] and error["type"] == "invalid_request_error"
    assert tokenized == []


def test_the_bound_is_never_above_the_true_count(embedded_engine):
    from specchat.app.token_bound import fewest_tokens

    tokenizer = embedded_engine.tokenizer
    # The worst case: text made of the vocabulary's longest token (a newline and 80 spaces).
    longest = tokenizer.convert_tokens_to_string([max(tokenizer.get_vocab(), key=len)])
    for text in ("word " * 1000, "ĊĠ" * 500, longest * 50, "你好" * 300, (DATA / "apache-2.0.txt").read_text()):
        assert 0 < fewest_tokens(tokenizer, text) <= len(tokenizer.encode(text, add_special_tokens=False))
