"""The OpenAI-compatible API on the live server, driven by the `openai` Python client: models,
answers streamed and not, follow-ups that reuse the KV, errors, the API key, and a burst of 16
concurrent streams that must come back as 16 correct, separate answers while the page stays up."""

from __future__ import annotations

import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from live_server import running_specchat

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow
KEY = "test-key-123"
MODEL = "embedded/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(embedded_dir):
    with running_specchat(env={**os.environ, "SPECCHAT_API_KEY": KEY}) as url:
        yield url


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
    assert [model.id for model in client.models.list()] == [MODEL]
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
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}v1", api_key="wrong", max_retries=0).models.list()


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
