"""Clients that go away and crowds of clients, over real loopback HTTP: a disconnect frees the
engine at once (issue 14, finding 1), more concurrent streams than the server has worker threads
all finish while the server keeps answering (finding 2), and the acceptance test: 64 concurrent
streams of which half disconnect at random moments. The server is the whole app (the Gradio page
and its routes, the API, the guard) in its own process, so the test's client threads measure it
without slowing it."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import httpx
import pytest

from api_server import api_process

pytestmark = pytest.mark.slow
WAIT = 120  # seconds: the bound on every network wait
LONG = "Tell me a long story about a dragon who learns to read."


@pytest.fixture(scope="module")
def server(embedded_dir):
    with api_process("embedded") as url:
        yield url


def body(question: str, max_tokens: int, stream: bool = True) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream}


def raw_stream(url: str, request: dict) -> socket.socket:
    """A streaming request on a bare socket, so the test decides exactly when the client leaves."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(request).encode()
    sock = socket.create_connection((host, int(port)), timeout=WAIT)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def read_chunks(sock: socket.socket, count: int) -> None:
    """Read until `count` SSE chunks have arrived."""
    received = b""
    while received.count(b"data: ") < count:
        block = sock.recv(65536)
        assert block, "the server closed the stream early"
        received += block


def streamed(url: str, request: dict, times: list | None = None) -> str:
    """A stream read to its end with httpx; the arrival time of each content chunk goes to `times`."""
    text = ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=request, timeout=WAIT) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["delta"].get("content"):
                text += choices[0]["delta"]["content"]
                if times is not None:
                    times.append(time.monotonic())
    return text


def first_token_after(url: str, question: str = "Say hello.") -> float:
    started, times = time.monotonic(), []
    streamed(url, body(question, 3), times)
    return times[0] - started


def test_a_client_that_leaves_mid_stream_frees_the_engine_at_once(server):
    sock = raw_stream(server, body(LONG, 400))  # about 20 s of answer if nobody stops it
    read_chunks(sock, 2)  # the role chunk and the first words
    sock.close()
    assert first_token_after(server) < 2


def test_a_client_that_gives_up_on_a_whole_answer_cancels_it(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/chat/completions", json=body(LONG, 400, stream=False), timeout=1.5)
    assert first_token_after(server) < 2


def test_more_streams_than_worker_threads_all_finish_while_the_server_answers(tiny_model_dir):
    """45 streams, more than the 40 worker threads that once each held one while waiting for
    the engine; the cheap routes answer throughout."""
    with api_process(str(tiny_model_dir)) as url:
        answers, cheap = [], []
        threads = [threading.Thread(target=lambda n=n: answers.append(streamed(url, body(f"Count to {n}.", 8))))
                   for n in range(45)]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            cheap.extend(timed_get(url, path) for path in ("/v1/models", "/"))
            time.sleep(0.2)
        for thread in threads:
            thread.join(WAIT)
        assert len(answers) == 45 and all(answers)
        assert cheap and max(cheap) < 2


def timed_get(url: str, path: str) -> float:
    started = time.monotonic()
    assert httpx.get(f"{url}{path}", timeout=WAIT).status_code == 200
    return time.monotonic() - started


def test_sixty_four_streams_half_of_them_leaving_at_random_moments(server):
    """The acceptance test: every stream that stays gets exactly its answer asked alone, the
    engine moves on within 2 s of the last client leaving, and cheap routes stay quick."""
    rng = random.Random(14)
    questions = [f"What is {n} times {n + 3}? Answer with the number." for n in range(64)]
    staying = set(rng.sample(range(64), 32))
    # Those who leave: after a random wait (most likely still in line) or a few chunks (mid-stream).
    leaving = {n: ("wait", rng.uniform(0, 2)) if rng.random() < 0.5 else ("read", rng.randint(2, 4))
               for n in range(64) if n not in staying}
    alone = {n: streamed(server, body(questions[n], 5)) for n in sorted(staying)}

    answers, chunk_times, left_at, cheap = {}, [], [], []
    start = threading.Barrier(65)

    def stay(n: int) -> None:
        start.wait()
        answers[n] = streamed(server, body(questions[n], 5), chunk_times)

    def leave(n: int) -> None:
        sock = raw_stream(server, body(questions[n], 400))  # long: only a cancel ends it soon
        start.wait()
        how, much = leaving[n]
        try:
            if how == "wait":
                time.sleep(much)
            else:
                read_chunks(sock, much)
        finally:
            sock.close()
            left_at.append(time.monotonic())

    threads = [threading.Thread(target=stay if n in staying else leave, args=(n,)) for n in range(64)]
    for thread in threads:
        thread.start()
    start.wait()
    while any(thread.is_alive() for thread in threads):
        cheap.extend(timed_get(server, path) for path in ("/v1/models", "/"))
        time.sleep(0.5)
    for thread in threads:
        thread.join(WAIT)

    assert answers == alone  # each stream that stayed got its own answer, as when asked alone
    assert len(left_at) == 32 and cheap and max(cheap) < 2
    last_left = max(left_at)
    later = [t for t in chunk_times if t > last_left]
    if later:  # streams were still running or waiting when the last client left: they went on at once
        assert min(later) - last_left < 2
    assert first_token_after(server) < 2
