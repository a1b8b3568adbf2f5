"""Clients of `flover serve` (docs/protocol.md): `Client` (blocking) and `AsyncClient` (asyncio).

    from flover.client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        print(c.generate("Hello", max_new_tokens=32)["text"])
        for event in c.stream("Hello", max_new_tokens=32):
            print(event.get("text") or "", end="")

One DEALER socket carries any number of concurrent requests; events are routed by request id
(returned exactly as sent: a string or an integer). A Client is not thread-safe: use one per
thread (or the AsyncClient).

A dead server is noticed: a socket monitor reports every lost connection (a server process that
ends closes it at once; TCP keepalives find a vanished host in ~8 s). Requests sent before a lost
connection can never be answered (a new connection is a new client to the server): each gets a
`connection_lost` error event at once instead of waiting forever. Messages larger than the
server's limit are refused here, before sending (`message_too_large`), instead of making ZeroMQ
drop the connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid
from collections import defaultdict, deque
from typing import AsyncIterator, Iterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from flover.protocol import ENGINE_UNRESPONSIVE, MAX_MESSAGE_BYTES, MESSAGE_TOO_LARGE, pack, tcp_keepalive, unpack
from flover.structured.spec import Structured

TERMINAL = ("final", "error")
CONNECTION_LOST = "connection_lost"  # client-side code: the connection dropped with the request in flight
HANDSHAKE_FAILED = "handshake_failed"  # client-side code: the server refused this client (CURVE)
_LOST_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
# The monitor also reports each (re)connection: requests sent while the connection is down get
# their `connection_lost` at once instead of waiting for a reply that cannot come.
_MONITORED = _LOST_EVENTS | zmq.EVENT_HANDSHAKE_SUCCEEDED


class FloverError(RuntimeError):
    def __init__(self, code: str, message: str, request_id: str | int | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.request_id = code, message, request_id


def _generate_message(request_id, prompt, input_ids, messages, stream: bool, params: dict) -> dict:
    if isinstance(params.get("structured"), Structured):  # on the wire: its map
        params = {**params, "structured": dataclasses.asdict(params["structured"])}
    bias = params.get("logit_bias")
    if isinstance(bias, dict):  # OpenAI's map {id: bias}: on the wire pairs (msgpack map keys are strings)
        params = {
            **params,
            "logit_bias": [[int(k) if isinstance(k, str) and k.isdecimal() else k, v] for k, v in bias.items()],
        }
    beside = {key: params.pop(key) for key in ("tools", "chat_template_kwargs") if key in params}
    message = {"op": "generate", "id": request_id, "stream": stream, "params": params}
    # OpenAI's tools and the template's variables, for the chat template: beside the messages
    message.update((key, value) for key, value in beside.items() if value is not None)
    given = [(k, v) for k, v in (("prompt", prompt), ("input_ids", input_ids), ("messages", messages)) if v is not None]
    if len(given) != 1:
        raise ValueError("pass exactly one of prompt, input_ids, messages")
    message[given[0][0]] = given[0][1]
    return message


def embed_message(request_id, input: str | list[int], **options) -> dict:
    """An embed op (docs/protocol.md): one input; `options` dimensions, truncate_prompt_tokens,
    document (a reranker's pair: `input` is the query, the final's embedding its score)."""
    return {"op": "embed", "id": request_id, "input": input, **options}


def _setup(sock: zmq.Socket, addr: str, curve_server_key: bytes | None, curve_client_cert: str | tuple | None):
    """Configure and connect; returns the monitor socket that reports lost connections.
    `curve_client_cert`: a secret certificate file, or the (public, secret) z85 key pair itself."""
    sock.setsockopt(zmq.LINGER, 0)
    tcp_keepalive(sock)
    if curve_server_key is not None:
        from zmq.auth import load_certificate

        public, secret = (
            curve_client_cert if isinstance(curve_client_cert, tuple) else load_certificate(curve_client_cert)
        )
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, curve_server_key
    monitor = sock.get_monitor_socket(_MONITORED)
    sock.connect(addr)
    return monitor


def _encode(message: dict, limit: int) -> bytes:
    """The message's bytes; FloverError, without sending, for one the server would refuse as too
    large. (One it cannot read, say with integer map keys, is answered `bad_message` with its id.)"""
    data = pack(message)
    if len(data) > limit:
        raise FloverError(
            MESSAGE_TOO_LARGE, f"the message is {len(data)} bytes; the server takes at most {limit}", message.get("id")
        )
    return data


def _lost_event(request_id, monitor_event: dict, addr: str) -> dict:
    if monitor_event["event"] == zmq.EVENT_DISCONNECTED:
        code, why = CONNECTION_LOST, f"the connection to {addr} was lost; this request's result cannot arrive"
    else:
        code, why = HANDSHAKE_FAILED, f"{addr} refused this client ({zmq.Event(monitor_event['event']).name})"
    return {"event": "error", "id": request_id, "code": code, "message": why, "local": True}


class Client:
    def __init__(
        self,
        addr: str,
        timeout: float | None = None,
        curve_server_key: bytes | None = None,
        curve_client_cert: str | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ):
        """`timeout`: seconds to wait for any event before raising TimeoutError (None: forever;
        a dead server is still noticed within seconds)."""
        self.addr = addr
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.monitor = _setup(self.sock, addr, curve_server_key, curve_client_cert)
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        self._events: dict[str | int | None, deque] = defaultdict(deque)
        self._pending: set = set()  # ids sent that have not had their final/error event yet
        self._down: dict | None = None  # the monitor event that lost the connection, until it is back
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self.last_heard = time.monotonic()  # any message, keepalives included: the server is alive

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def send(self, message: dict) -> None:
        """Raises FloverError(message_too_large) without sending what the server would refuse.
        While the connection is lost a request is not sent: its `connection_lost` comes at once."""
        data = _encode(message, self.max_message_bytes)
        rid, is_request = message.get("id"), message.get("op") == "generate"
        awaited = is_request or rid in self._pending  # (before the watch below answers and clears the pending)
        self._watch_connection()
        if self._down is None and self._hand_over(data):
            if is_request:
                self._pending.add(rid)
            return
        # lost (before or while sending): nothing is sent; an awaited message is answered
        if awaited and not self._events.get(rid):  # (unless the watch answered it just now)
            self._events[rid].append(_lost_event(rid, self._down, self.addr))
        self._pending.discard(rid)

    def _hand_over(self, data: bytes) -> bool:
        """Give zmq the message without ever waiting for good: when a refused handshake has dropped
        the connection's queue, a blocking send would wait forever, so wait for room only while
        the monitor reports no loss (False: lost meanwhile). Times out as next_event does."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            try:
                self.sock.send(data, zmq.NOBLOCK)
                return True
            except zmq.Again:
                pass
            self._watch_connection()
            if self._down is not None:
                return False
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.addr} took no message within {self.timeout} s")
            self.sock.poll(50, zmq.POLLOUT)

    def _receive(self, timeout: float | None) -> bool:
        """Wait for the socket or the monitor; file what arrives. False on timeout."""
        ready = dict(self._poller.poll(None if timeout is None else int(timeout * 1000)))
        if not ready:
            return False
        while self.sock.poll(0):  # everything that arrived before a lost connection counts
            event = unpack(self.sock.recv())
            self.last_heard = time.monotonic()
            if event.get("event") == "keepalive":
                continue
            if event.get("event") in TERMINAL:
                self._pending.discard(event.get("id"))
            self._events[event.get("id")].append(event)
        if self.monitor in ready:
            self._watch_connection()
        return True

    def _watch_connection(self) -> None:
        """File what the monitor reported: a loss ends every request waiting for a reply."""
        while self.monitor.poll(0):
            lost = parse_monitor_message(self.monitor.recv_multipart())
            if lost["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._down = None
                continue
            self._down = self._down or lost  # the first report says why (a refusal, then its disconnect)
            for rid in self._pending:
                self._events[rid].append(_lost_event(rid, lost, self.addr))
            self._pending.clear()

    def next_event(self, request_id, timeout: float | None = None) -> dict:
        """The next event for `request_id` (events of other requests are kept for later)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._events.get(request_id):
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._receive(wait) and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no reply from the server for request {request_id!r} within {timeout} s")
        queue = self._events[request_id]
        event = queue.popleft()
        if not queue:
            del self._events[request_id]
        return event

    def next_any(self, timeout: float | None = None) -> dict | None:
        """The next event of any request (None after `timeout` seconds without one)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for rid, queue in list(self._events.items()):
                if queue:
                    return self.next_event(rid)
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._receive(wait) and deadline is not None and time.monotonic() >= deadline:
                return None

    def stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        messages: list | None = None,
        request_id=None,
        **params,
    ) -> Iterator[dict]:
        """Token events ({"event": "token", "token_ids", "text"}) and then the final event.
        An error event raises FloverError."""
        rid = self.new_id() if request_id is None else request_id
        self.send(_generate_message(rid, prompt, input_ids, messages, True, params))
        while True:
            event = self.next_event(rid)
            if event["event"] == "error":
                raise FloverError(event["code"], event["message"], rid)
            yield event
            if event["event"] == "final":
                return

    def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: list[int] | None = None,
        messages: list | None = None,
        request_id=None,
        **params,
    ) -> dict:
        """The final event: text, token_ids, finish_reason, usage, timings."""
        rid = self.new_id() if request_id is None else request_id
        self.send(_generate_message(rid, prompt, input_ids, messages, False, params))
        return self.wait(rid)

    def embed(self, input: str | list[int], *, request_id=None, **options) -> dict:
        """One input's final event: its `embedding`, usage, timings. `options`: dimensions,
        truncate_prompt_tokens, document (a reranker's pair: the embedding is its score). Many
        inputs: send them all first (embed_message) and wait for each, so that they share the
        server's iterations."""
        rid = self.new_id() if request_id is None else request_id
        self.send(embed_message(rid, input, **options))
        return self.wait(rid)

    def wait(self, request_id) -> dict:
        """The final event of a request sent earlier (raises FloverError on an error event)."""
        while True:
            event = self.next_event(request_id)
            if event["event"] == "error":
                raise FloverError(event["code"], event["message"], request_id)
            if event["event"] == "final":
                return event

    def cancel(self, request_id) -> None:
        """The request's own stream/generate call then ends with finish_reason "cancelled"."""
        self.send({"op": "cancel", "id": request_id})

    def _ask(self, op: str, timeout: float) -> dict:
        rid = self.new_id()
        # pending before it is sent: a connection found lost while sending answers it too (a
        # refused CURVE handshake is often reported before the first message goes out)
        self._pending.add(rid)
        self.send({"op": op, "id": rid})
        event = self.next_event(rid, timeout)
        self._pending.discard(rid)
        if event["event"] == "error":
            raise FloverError(event["code"], event["message"], rid)
        return event

    def health(self, timeout: float = 5.0) -> dict:
        return self._ask("health", timeout)

    def stats(self, timeout: float = 5.0) -> dict:
        return self._ask("stats", timeout)


class AsyncClient:
    """The same operations for asyncio; many requests may run concurrently on one client."""

    def __init__(
        self,
        addr: str,
        curve_server_key: bytes | None = None,
        curve_client_cert: str | tuple | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        silence_timeout: float | None = None,
    ):
        """`silence_timeout`: a request whose server sent nothing at all (the server keeps a
        connection with requests in flight alive with a keepalive a second) for this many seconds
        ends with an `engine_unresponsive` error (None: it waits)."""
        self.addr = addr
        self.silence_timeout = silence_timeout
        self.last_heard = time.monotonic()
        self._opened: dict = {}  # request id -> when its request was sent (silence counts from then at most)
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.monitor = _setup(self.sock, addr, curve_server_key, curve_client_cert)
        self.max_message_bytes = max_message_bytes
        self._queues: dict[str | int, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self._down: dict | None = None  # as in Client
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()

    def _dispatch(self, event: dict) -> None:
        queue = self._queues.get(event.get("id"))
        if queue is not None:
            queue.put_nowait(event)

    async def _read(self) -> None:
        while True:
            event = unpack(await self.sock.recv())
            self.last_heard = time.monotonic()
            self._dispatch(event)

    async def _mind_silence(self) -> None:
        """Every open request whose server has been silent past `silence_timeout` gets its error."""
        while True:
            await asyncio.sleep(min(1.0, self.silence_timeout / 4))
            now = time.monotonic()
            for rid, opened in list(self._opened.items()):
                silent = now - max(self.last_heard, opened)
                if silent > self.silence_timeout and rid in self._queues:
                    self._opened.pop(rid, None)
                    self._dispatch(
                        {
                            "event": "error",
                            "id": rid,
                            "code": ENGINE_UNRESPONSIVE,
                            "message": f"{self.addr} sent nothing for {silent:.0f} s (a frozen server or pipeline "
                            f"stage; the bound: {self.silence_timeout:g} s); this request's result may never arrive",
                            "local": True,
                        }
                    )

    async def _watch(self) -> None:
        """A lost connection: every open request gets its `connection_lost` error (after any event
        that arrived before the loss)."""
        while True:
            lost = parse_monitor_message(await self.monitor.recv_multipart())
            if lost["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._down = None
                continue
            self._down = self._down or lost  # the first report says why (a refusal, then its disconnect)
            while await self.sock.poll(0):
                self._dispatch(unpack(await self.sock.recv()))
            for rid in list(self._queues):
                self._dispatch(_lost_event(rid, lost, self.addr))

    def _open(self, rid) -> asyncio.Queue:
        self._start()
        self._queues[rid] = asyncio.Queue()
        self._opened[rid] = time.monotonic()
        return self._queues[rid]

    def _start(self) -> None:
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._read()), loop.create_task(self._watch())]
            if self.silence_timeout is not None:
                self._tasks.append(loop.create_task(self._mind_silence()))

    async def _send(self, data: bytes) -> bool:
        """Give zmq the message unless the connection is lost (False; the watch answers the open
        requests): when a refused handshake has dropped the connection's queue, a plain send
        would wait forever, so this waits for room only while no loss is reported."""
        self._start()
        while self._down is None:
            try:
                await self.sock.send(data, zmq.NOBLOCK)
                return True
            except zmq.Again:
                await self.sock.poll(50, zmq.POLLOUT)
        return False

    async def _send_awaited(self, rid, queue: asyncio.Queue, data: bytes) -> None:
        """Send a message whose reply `queue` awaits; while the connection is lost it is not sent
        and the queue gets the loss at once (a loss while sending: the watch answers it)."""
        if self._down is not None:
            queue.put_nowait(_lost_event(rid, self._down, self.addr))
        else:
            await self._send(data)

    async def _events(self, message: dict) -> AsyncIterator[dict]:
        """Send a generate message; yield its events up to the final one (an error raises)."""
        rid = message["id"]
        data = _encode(message, self.max_message_bytes)
        queue = self._open(rid)
        try:
            await self._send_awaited(rid, queue, data)
            while True:
                event = await queue.get()
                if event["event"] == "error":
                    raise FloverError(event["code"], event["message"], rid)
                yield event
                if event["event"] == "final":
                    return
        finally:
            self._queues.pop(rid, None)
            self._opened.pop(rid, None)

    def _new_id(self, request_id):
        return f"{self._prefix}-{next(self._ids)}" if request_id is None else request_id

    async def stream(
        self, prompt: str | None = None, *, input_ids=None, messages=None, request_id=None, **params
    ) -> AsyncIterator[dict]:
        rid = self._new_id(request_id)
        async for event in self._events(_generate_message(rid, prompt, input_ids, messages, True, params)):
            yield event

    async def generate(
        self, prompt: str | None = None, *, input_ids=None, messages=None, request_id=None, **params
    ) -> dict:
        rid = self._new_id(request_id)
        async for event in self._events(_generate_message(rid, prompt, input_ids, messages, False, params)):
            if event["event"] == "final":
                return event
        raise FloverError("internal_error", "the event stream ended without a final event", rid)

    async def embed(self, input: str | list[int], *, request_id=None, **options) -> dict:
        rid = self._new_id(request_id)
        async for event in self._events(embed_message(rid, input, **options)):
            if event["event"] == "final":
                return event
        raise FloverError("internal_error", "the event stream ended without a final event", rid)

    async def cancel(self, request_id) -> None:
        await self._send(pack({"op": "cancel", "id": request_id}))  # lost: its request has been answered

    async def _ask(self, op: str, timeout: float) -> dict:
        rid = self._new_id(None)
        queue = self._open(rid)
        try:
            await asyncio.wait_for(self._send_awaited(rid, queue, pack({"op": op, "id": rid})), timeout)
            event = await asyncio.wait_for(queue.get(), timeout)
        finally:
            self._queues.pop(rid, None)
            self._opened.pop(rid, None)
        if event["event"] == "error":
            raise FloverError(event["code"], event["message"], rid)
        return event

    async def health(self, timeout: float = 5.0) -> dict:
        return await self._ask("health", timeout)

    async def stats(self, timeout: float = 5.0) -> dict:
        return await self._ask("stats", timeout)
