"""A key worth having (app/key_attempts.py): an empty or short key is refused at start, and wrong
keys are answered ever later per client, in line, while the right key is never held up."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from test_cli import assert_bad_input, specchat
from test_security import KEY, run_async

from specchat.app.key_attempts import FREE_FAILURES, KeyAttempts, checked_api_key, failure_delay
from specchat.app.security import Guard
from specchat.core.errors import InputError


def test_an_empty_or_short_key_is_refused_and_a_long_one_kept():
    assert checked_api_key(None) is None
    for empty in ("", "   "):
        with pytest.raises(InputError, match="is empty"):
            checked_api_key(empty)
    with pytest.raises(InputError, match="has 5 characters: give at least 16"):
        checked_api_key("abcde")
    assert checked_api_key(KEY) == KEY


@pytest.mark.parametrize("how", ["option", "environment"])
def test_the_server_refuses_to_start_with_an_empty_key(how, monkeypatch):
    if how == "option":
        completed = specchat("--no-browser", "--api-key", "", timeout=120)
    else:
        monkeypatch.setenv("SPECCHAT_API_KEY", "")
        completed = specchat("--no-browser", timeout=120)
    assert_bad_input(completed, "is empty")


def test_three_hundred_guesses_take_minutes_and_a_mistyped_key_costs_nothing():
    assert [failure_delay(n) for n in range(1, FREE_FAILURES + 1)] == [0.0] * FREE_FAILURES
    assert sum(failure_delay(n) for n in range(1, 301)) >= 60


def test_failures_are_forgotten_after_a_quiet_minute_and_logged_once_per_burst():
    now, lines = [0.0], []
    attempts = KeyAttempts(clock=lambda: now[0], log=lines.append)
    delays = [attempts.record_failure("10.0.0.1") for _ in range(FREE_FAILURES + 3)]
    assert delays[:FREE_FAILURES] == [0.0] * FREE_FAILURES and delays[-1] > delays[-2] > delays[-3] > 0
    assert attempts.record_failure("10.0.0.2") == 0.0  # another client has its own count
    assert len(lines) == 1 and "10.0.0.1" in lines[0]
    now[0] += 61
    assert attempts.record_failure("10.0.0.1") == 0.0
    assert len(lines) == 1


def test_parallel_wrong_keys_wait_in_line_while_the_right_key_passes_at_once():
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    lines = []
    guard = Guard(app, KEY, "127.0.0.1", attempts=KeyAttempts(log=lines.append))
    guesses = FREE_FAILURES + 4
    expected_wait = sum(failure_delay(n) for n in range(1, guesses + 1))

    async def requests():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7860") as client:
            started = time.monotonic()
            wrong = [asyncio.create_task(client.get("/v1/models", headers={"Authorization": f"Bearer guess-{n}"}))
                     for n in range(guesses)]
            await asyncio.sleep(0.1)
            right = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            right_after = time.monotonic() - started
            no_key = await client.get("/v1/models")  # not a guess: refused, never delayed or counted
            no_key_after = time.monotonic() - started
            statuses = [response.status_code for response in await asyncio.gather(*wrong)]
            return right.status_code, right_after, no_key.status_code, no_key_after, statuses, \
                time.monotonic() - started

    right, right_after, no_key, no_key_after, statuses, took = run_async(requests())
    assert right == 200 and right_after < 1.0
    assert no_key == 401 and no_key_after < 1.5
    assert statuses == [401] * guesses and took >= expected_wait * 0.95
    assert reached == ["/v1/models"] and len(lines) == 1


def test_wrong_keys_at_the_login_form_are_slowed_too():
    async def app(scope, receive, send):
        raise AssertionError("the form is the guard's own")

    attempts = KeyAttempts(log=lambda line: None)
    guard = Guard(app, KEY, "127.0.0.1", attempts=attempts)

    async def requests():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:7860") as client:
            for n in range(FREE_FAILURES + 1):
                response = await client.post("/login", data={"key": f"guess-{n}"})
                assert response.status_code == 401
            started = time.monotonic()
            assert (await client.post("/login", data={"key": "one more"})).status_code == 401
            slowed = time.monotonic() - started
            assert (await client.post("/login", data={"key": KEY})).status_code == 303
            return slowed

    assert run_async(requests()) >= failure_delay(FREE_FAILURES + 2) * 0.95
