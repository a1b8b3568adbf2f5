"""Connection limits of the HTTP front: a slow or half-sent request cannot hold a connection, and
open connections cannot exhaust the front's file descriptors.

uvicorn's HTTP/1.1 protocol (h11) times out only idle keep-alive connections: a client that sends
part of its headers or body and then nothing keeps its connection forever. `GuardedH11Protocol`
adds, per connection, a deadline for the headers of each request (from the connection's start or
the previous response) and one for its body (from the end of the headers), and refuses a
connection beyond `max_connections` at once by closing it.
"""

from __future__ import annotations

import asyncio
import logging
import resource

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from flover.server.http_front import HttpLimits

log = logging.getLogger("flover.http")


def usable_connections(wanted: int, reserve: int = 64) -> int:
    """`wanted`, lowered to what the file-descriptor limit allows (raised to its hard limit first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - reserve))


def guarded_protocol(limits: HttpLimits) -> type:
    """An H11Protocol class with `limits` (uvicorn takes the class as `http=`)."""

    class Guarded(GuardedH11Protocol):
        pass

    Guarded.limits = limits
    return Guarded


class GuardedH11Protocol(H11Protocol):
    limits = HttpLimits()

    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:
        if len(self.connections) >= self.limits.max_connections:
            log.warning("%d connections open: refusing one more", len(self.connections))
            self._refused = True
            transport.abort()
            return
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        """Keep one deadline for what the client owes now: headers (h11 IDLE after data came or a
        connection began), or the body (SEND_BODY); none while the answer is being made."""
        state = self.conn.their_state
        owes = (
            "headers"
            if state is h11.IDLE and not self._between_requests()
            else "body"
            if state is h11.SEND_BODY
            else None
        )
        if owes == self._waiting_for:
            return
        self._disarm()
        self._waiting_for = owes
        if owes is not None:
            seconds = self.limits.header_timeout if owes == "headers" else self.limits.body_timeout
            self._deadline = self.loop.call_later(seconds, self._expired, owes, seconds)

    def _between_requests(self) -> bool:
        """Idle after an answer with nothing received yet: uvicorn's keep-alive timeout holds."""
        return self.timeout_keep_alive_task is not None

    def _disarm(self) -> None:
        deadline = getattr(self, "_deadline", None)
        if deadline is not None:
            deadline.cancel()
        self._deadline, self._waiting_for = None, None

    def _expired(self, owed: str, seconds: float) -> None:
        self._deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            log.info("closing a connection whose %s did not arrive within %g s", owed, seconds)
            self.transport.close()
