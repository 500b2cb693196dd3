"""The server's HTTP protocol with a deadline on each request's head (its line and headers).

uvicorn's h11 protocol waits for a request head as long as a client cares to take: its keep-alive
timer ends only a connection that sends nothing, and a new connection has no timer at all, so a
client that dribbles its headers a byte at a time holds a connection (and its memory) forever, and
a few hundred of them hold the server's file descriptors. Browsers and API clients send a head in
one packet: a connection whose head is not complete `SPECCHAT_HEADER_SECONDS` (10) after it opens,
or after its previous response, is closed. A request body is not timed: an upload over a slow link
may take minutes, and the body limits bound what it can cost.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..core.env_settings import env_number


class HeadDeadlineProtocol(H11Protocol):
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._await_a_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head has come: the request is the app's now
            self._cancel_the_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # kept alive: the next head is timed as the first was
            self._await_a_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_the_deadline()
        super().connection_lost(exc)

    def _await_a_head(self) -> None:
        self._cancel_the_deadline()
        self._head_deadline = self.loop.call_later(head_seconds(), self._too_slow)

    def _cancel_the_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _too_slow(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def head_seconds() -> float:
    """How long a client may take to send a request's head: $SPECCHAT_HEADER_SECONDS, else 10 s
    (`launch` reads it first, so a bad value fails at start, not at each connection)."""
    return env_number("SPECCHAT_HEADER_SECONDS", 10.0, wanted="a positive number of seconds")
