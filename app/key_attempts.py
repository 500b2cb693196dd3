"""A key worth having: what `--api-key` must be, and wrong keys slowed down per client.

A wrong key (a Bearer header, the login cookie or the /login form that does not match) is
answered after a delay that doubles with each recent failure from the same client, and one
client's wrong attempts wait in line, so guesses cannot run in parallel either. A right key is
never delayed, from any client. Requests that present no key at all are not guesses and pass.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

from ..core.errors import InputError

SHORTEST_KEY = 16  # characters: a short key is guessed whatever the delay
FREE_FAILURES = 3  # a person mistyping is not slowed down
FIRST_DELAY_S = 0.25
LONGEST_DELAY_S = 2.0  # 300 guesses then take about ten minutes
QUIET_S = 60.0  # a client's failures are forgotten after this long without one


def checked_api_key(value: str | None) -> str | None:
    """The key the server requires (None: none asked for); InputError for one not worth having."""
    if value is None:
        return None
    if not value.strip():
        raise InputError("--api-key (or $SPECCHAT_API_KEY) is empty: give a key of at least "
                         f"{SHORTEST_KEY} characters, or leave it out for a server without a key")
    if len(value) < SHORTEST_KEY:
        raise InputError(f"the API key has {len(value)} characters: give at least {SHORTEST_KEY} "
                         "(e.g. python -c \"import secrets; print(secrets.token_urlsafe(24))\")")
    return value


def failure_delay(failures: int) -> float:
    """Seconds before answering a client's `failures`-th recent wrong key."""
    if failures <= FREE_FAILURES:
        return 0.0
    return min(LONGEST_DELAY_S, FIRST_DELAY_S * 2 ** (failures - FREE_FAILURES - 1))


class KeyAttempts:
    """Recent wrong keys per client address; `delay` turns a count into seconds (tests that
    send hundreds of wrong keys on purpose pass one without delays)."""

    def __init__(self, delay: Callable[[int], float] = failure_delay, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)):
        self.delay, self.clock, self.log = delay, clock, log
        self._failures: dict[str, tuple[int, float]] = {}  # client -> (recent failures, last one's time)
        self._queues: dict[str, asyncio.Lock] = {}

    def record_failure(self, client: str) -> float:
        """Count one wrong key from `client`; the delay before answering it."""
        now = self.clock()
        self._forget_quiet(now)
        failures = self._failures.get(client, (0, now))[0] + 1
        self._failures[client] = (failures, now)
        if failures == FREE_FAILURES + 1:  # once per burst
            self.log(f"specchat: wrong keys from {client}: each further one is answered after a delay "
                     f"(up to {LONGEST_DELAY_S:g} s) until {QUIET_S:g} s pass without one")
        return self.delay(failures)

    async def failed(self, client: str) -> None:
        """Wait as long as this wrong key costs, after the client's earlier wrong keys."""
        delay = self.record_failure(client)
        if delay:
            async with self._queues.setdefault(client, asyncio.Lock()):
                await asyncio.sleep(delay)

    def _forget_quiet(self, now: float) -> None:
        quiet = [client for client, (_, last) in self._failures.items() if now - last > QUIET_S]
        for client in quiet:
            del self._failures[client]
            lock = self._queues.get(client)
            if lock is not None and not lock.locked():
                del self._queues[client]
