"""Clients of `flover serve` (docs/protocol.md): `Client` (blocking) and `AsyncClient` (asyncio).

    from flover.client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        print(c.generate("Hello", max_new_tokens=32)["text"])
        for event in c.stream("Hello", max_new_tokens=32):
            print(event.get("text") or "", end="")

One DEALER socket carries any number of concurrent requests; events are routed by request id.
A Client is not thread-safe: use one per thread (or the AsyncClient).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import defaultdict, deque
from typing import AsyncIterator, Iterator

import zmq
import zmq.asyncio

from flover.server.protocol import pack, unpack

TERMINAL = ("final", "error")


class FloverError(RuntimeError):
    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id = code, message, request_id


def _generate_message(request_id: str, prompt, input_ids, messages, stream: bool, params: dict) -> dict:
    message = {"op": "generate", "id": request_id, "stream": stream, "params": params}
    given = [(k, v) for k, v in (("prompt", prompt), ("input_ids", input_ids), ("messages", messages)) if v is not None]
    if len(given) != 1:
        raise ValueError("pass exactly one of prompt, input_ids, messages")
    message[given[0][0]] = given[0][1]
    return message


def _setup(sock: zmq.Socket, addr: str, curve_server_key: bytes | None, curve_client_cert: str | None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    if curve_server_key is not None:
        from zmq.auth import load_certificate

        public, secret = load_certificate(curve_client_cert)
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, curve_server_key
    sock.connect(addr)


class Client:
    def __init__(self, addr: str, timeout: float | None = None, curve_server_key: bytes | None = None,
                 curve_client_cert: str | None = None):
        """`timeout`: seconds to wait for any event before raising TimeoutError (None: forever)."""
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        _setup(self.sock, addr, curve_server_key, curve_client_cert)
        self.timeout = timeout
        self._events: dict[str, deque] = defaultdict(deque)
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def send(self, message: dict) -> None:
        self.sock.send(pack(message))

    def next_event(self, request_id: str | None, timeout: float | None = None) -> dict:
        """The next event for `request_id` (events of other requests are kept for later)."""
        queue = self._events[request_id]
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while not queue:
            wait = None if deadline is None else max(0, deadline - time.monotonic())
            if not self.sock.poll(None if wait is None else int(wait * 1000)):
                raise TimeoutError(f"no reply from the server for request {request_id!r} within {timeout} s")
            event = unpack(self.sock.recv())
            if event.get("event") != "keepalive":
                self._events[event.get("id")].append(event)
        event = queue.popleft()
        if not queue:
            del self._events[request_id]
        return event

    def next_any(self, timeout: float | None = None) -> dict | None:
        """The next event of any request (None after `timeout` seconds without one)."""
        for rid, queue in list(self._events.items()):
            if queue:
                return self.next_event(rid)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0, deadline - time.monotonic())
            if not self.sock.poll(None if wait is None else int(wait * 1000)):
                return None
            event = unpack(self.sock.recv())
            if event.get("event") != "keepalive":
                return event

    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               messages: list | None = None, request_id: str | None = None, **params) -> Iterator[dict]:
        """Token events ({"event": "token", "token_ids", "text"}) and then the final event.
        An error event raises FloverError."""
        rid = request_id or self.new_id()
        self.send(_generate_message(rid, prompt, input_ids, messages, True, params))
        while True:
            event = self.next_event(rid)
            if event["event"] == "error":
                raise FloverError(event["code"], event["message"], rid)
            yield event
            if event["event"] == "final":
                return

    def generate(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                 messages: list | None = None, request_id: str | None = None, **params) -> dict:
        """The final event: text, token_ids, finish_reason, usage, timings."""
        rid = request_id or self.new_id()
        self.send(_generate_message(rid, prompt, input_ids, messages, False, params))
        return self.wait(rid)

    def wait(self, request_id: str) -> dict:
        """The final event of a request sent earlier (raises FloverError on an error event)."""
        while True:
            event = self.next_event(request_id)
            if event["event"] == "error":
                raise FloverError(event["code"], event["message"], request_id)
            if event["event"] == "final":
                return event

    def cancel(self, request_id: str) -> None:
        """The request's own stream/generate call then ends with finish_reason "cancelled"."""
        self.send({"op": "cancel", "id": request_id})

    def _ask(self, op: str, timeout: float) -> dict:
        rid = self.new_id()
        self.send({"op": op, "id": rid})
        return self.next_event(rid, timeout)

    def health(self, timeout: float = 5.0) -> dict:
        return self._ask("health", timeout)

    def stats(self, timeout: float = 5.0) -> dict:
        return self._ask("stats", timeout)


class AsyncClient:
    """The same operations for asyncio; many requests may run concurrently on one client."""

    def __init__(self, addr: str, curve_server_key: bytes | None = None, curve_client_cert: str | None = None):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        _setup(self.sock, addr, curve_server_key, curve_client_cert)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(0)
        self.ctx.term()

    async def _read(self) -> None:
        while True:
            event = unpack(await self.sock.recv())
            queue = self._queues.get(event.get("id"))
            if queue is not None:
                queue.put_nowait(event)

    def _open(self, rid: str) -> asyncio.Queue:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        self._queues[rid] = asyncio.Queue()
        return self._queues[rid]

    async def _events(self, message: dict) -> AsyncIterator[dict]:
        """Send a generate message; yield its events up to the final one (an error raises)."""
        rid = message["id"]
        queue = self._open(rid)
        try:
            await self.sock.send(pack(message))
            while True:
                event = await queue.get()
                if event["event"] == "error":
                    raise FloverError(event["code"], event["message"], rid)
                yield event
                if event["event"] == "final":
                    return
        finally:
            self._queues.pop(rid, None)

    async def stream(self, prompt: str | None = None, *, input_ids=None, messages=None, request_id=None,
                     **params) -> AsyncIterator[dict]:
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        async for event in self._events(_generate_message(rid, prompt, input_ids, messages, True, params)):
            yield event

    async def generate(self, prompt: str | None = None, *, input_ids=None, messages=None, request_id=None,
                       **params) -> dict:
        rid = request_id or f"{self._prefix}-{next(self._ids)}"
        async for event in self._events(_generate_message(rid, prompt, input_ids, messages, False, params)):
            if event["event"] == "final":
                return event
        raise FloverError("internal_error", "the event stream ended without a final event", rid)

    async def cancel(self, request_id: str) -> None:
        await self.sock.send(pack({"op": "cancel", "id": request_id}))

    async def _ask(self, op: str, timeout: float) -> dict:
        rid = f"{self._prefix}-{next(self._ids)}"
        queue = self._open(rid)
        try:
            await self.sock.send(pack({"op": op, "id": rid}))
            return await asyncio.wait_for(queue.get(), timeout)
        finally:
            self._queues.pop(rid, None)

    async def health(self, timeout: float = 5.0) -> dict:
        return await self._ask("health", timeout)

    async def stats(self, timeout: float = 5.0) -> dict:
        return await self._ask("stats", timeout)
