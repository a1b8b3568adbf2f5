"""`flover serve`: rank 0's ZeroMQ loop around the engine.

One thread owns the socket and the engine. Each turn of the loop reads the waiting messages (for
at most `max_intake_seconds` while requests are running), answers the cheap ones (health, stats,
errors) at once, queues generate requests, and runs one engine iteration if anything is in
flight: a request that arrives while others generate joins the running batch at the next
iteration. Idle, the loop blocks in a socket poll (~0% CPU).

Who owns a request: the connection it came on, never a name a client picks. A socket that sets
its own ZMQ_ROUTING_ID is refused (`routing_id_not_allowed`), so every owner is an identity that
ZeroMQ generated for one connection (a zero byte and a counter from a random start, never told to
anyone). A socket monitor reports every closed connection; its requests are cancelled before the
next event is sent, so an identity that falls free carries no request another connection could
receive. With CURVE the authenticated public key is logged with each request.

Every generate request gets exactly one `final` or one `error` event. Events a client does not
read yet wait in its backlog (ZeroMQ's queue, then ours) and are delivered in order; a backlog
over `max_client_backlog_bytes` cancels that client's requests, each with a `slow_client` error
at the end of its backlog. A client that disappears becomes unroutable; the first send to it
fails (ROUTER_MANDATORY) and its requests are cancelled. Clients with requests in flight get a
`keepalive` event every second, so that a vanished client is noticed within a second, and a client
can bound the server's silence (AsyncClient's `silence_timeout`: the HTTP front's engine timeout).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils.monitor import parse_monitor_message

from flover import protocol
from flover.engine.intake import PromptTooLong
from flover.engine.interface import ServingEngine
from flover.parallel.pipeline import StageTimeout
from flover.request import EmbedParams, RequestInput, RequestOutput
from flover.server.metrics import ServingMetrics
from flover.server.tokenizing import FairWorker, Job

log = logging.getLogger("flover.serve")
# On exit the socket waits this long for zmq to hand over what was sent last (linger is 0 while
# serving, so that nothing ever waits on a client that stopped reading)
EXIT_FLUSH_MS = 2000


@dataclass
class ServeConfig:
    bind: str = "tcp://127.0.0.1:5555"
    max_waiting: int = 256  # queued requests beyond the slots; more get `overloaded`
    max_message_bytes: int = protocol.MAX_MESSAGE_BYTES  # one message, all frames; a larger frame drops the connection
    max_client_backlog_bytes: int = 64 << 20  # unread events kept for one client before `slow_client`
    drain_timeout: float = 30.0  # seconds to finish in-flight requests after SIGTERM/SIGINT
    stats_interval: float = 60.0  # seconds between summary log lines
    keepalive_interval: float = 1.0
    max_messages_per_turn: int = 1000  # a flood cannot starve the running requests
    max_intake_seconds: float = 0.02  # ... nor can expensive messages (tokenizing) while requests run
    curve_secret_key: str | None = None  # server certificate (zmq.auth format), enables CURVE
    curve_allowed_clients: str | None = None  # directory of allowed client public certificates
    curve_extra_clients: tuple[bytes, ...] = ()  # public keys (z85) allowed besides: the HTTP front's own
    handle_signals: bool = True  # SIGTERM/SIGINT/SIGUSR1 start the drain (main thread only)


class AllowedKeys:
    """ZAP's CURVE check: the public certificates of a directory (read once, at start-up) and
    the keys given besides."""

    def __init__(self, directory: str, extra: tuple[bytes, ...]):
        import zmq.auth

        self.keys = set(zmq.auth.load_certificates(directory)) | set(extra)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


@dataclass
class InFlight:
    identity: bytes  # the connection it came on
    client_id: str | int  # the id the client chose, sent back exactly as it came
    stream: bool
    envelope: bool  # came from a REQ socket: exactly one reply, no keepalives
    fd: int  # the connection's socket (SRCFD): the monitor reports its closing by this number
    user: str | None = None  # the CURVE public key (z85) that sent it
    overflowed: bool = False  # cancelled because its client stopped reading
    tokens_sent: int = 0  # streamed so far (queued in order for the client)
    last_token_at: float | None = None  # when its previous tokens came (inter-token latency)
    arrived: float = 0.0  # time.perf_counter() when its message was read


@dataclass
class Backlog:
    """Events for one client that its connection could not take yet, in order."""

    frames: deque
    bytes: int = 0


class Daemon:
    def __init__(self, engine: ServingEngine, config: ServeConfig, model_name: str = ""):
        self.engine, self.config, self.model_name = engine, config, model_name
        self.ctx = zmq.Context()
        self.auth = None  # ZAP authenticator thread when CURVE is on
        self.sock = self._socket()
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.inflight: dict[str, InFlight] = {}  # engine request id -> who asked
        self.by_client: dict[tuple[bytes, str | int], str] = {}  # (connection, client's id) -> engine id
        self.backlogs: dict[bytes, Backlog] = {}
        self._engine_ids = itertools.count()
        self.draining = False
        self.drain_deadline = float("inf")
        self.started = time.time()
        self.metrics = ServingMetrics()
        self.counters = {
            "requests": 0,
            "completed": 0,
            "errors": 0,
            "cancelled": 0,
            "tokens_out": 0,
            "rejected": 0,
            "clients_gone": 0,
            "slow_clients": 0,
        }
        self._last_keepalive = self._last_stats = time.monotonic()
        # Text prompts are tokenized off the loop, connections taking turns; chats are rendered
        # (in the template's bounded child) and tokenized by a worker of their own, and requests with
        # a structure compiled by a third, so that neither a slow template nor a costly grammar ever
        # delays a request that has none.
        self.tokenizing = FairWorker(self._prepare)
        self.rendering = FairWorker(self._prepare)
        self.compiling = FairWorker(self._prepare)
        self.workers = (self.tokenizing, self.rendering, self.compiling)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        for worker in self.workers:
            self.poller.register(worker.wakeup_fd, zmq.POLLIN)

    # -- socket ----------------------------------------------------------------------------
    def _socket(self) -> zmq.Socket:
        c = self.config
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable peer -> error, not a silent drop
        sock.setsockopt(zmq.MAXMSGSIZE, c.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, 1000)  # more waits in our backlog (Backlog), where it is counted
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.LINGER, 0)
        protocol.tcp_keepalive(sock)
        if c.curve_secret_key:
            self._enable_curve(sock)
        elif not _is_local(c.bind):
            log.warning("binding %s without CURVE: anyone who can reach it can use the model", c.bind)
        try:
            sock.bind(c.bind)
        except zmq.ZMQError as e:
            sock.close(0)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()
            raise OSError(f"cannot listen on {c.bind}: {os.strerror(e.errno)}") from None
        return sock

    def _enable_curve(self, sock: zmq.Socket) -> None:
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.auth.load_certificate(self.config.curve_secret_key)
        if secret is None:
            raise ValueError(f"{self.config.curve_secret_key}: not a secret-key certificate")
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        allowed = self.config.curve_allowed_clients
        if not allowed or not Path(allowed).is_dir():
            raise ValueError("CURVE needs --curve-allowed-clients DIR (the clients' public certificates)")
        self.auth.configure_curve_callback("*", AllowedKeys(allowed, self.config.curve_extra_clients))
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True

    def _send(self, identity: bytes, event: dict, envelope: bool = False) -> bool:
        """Send now, or queue behind what the client has not read yet. False if the client is gone."""
        frames = [identity, b"", protocol.pack(event)] if envelope else [identity, protocol.pack(event)]
        backlog = self.backlogs.get(identity)
        if backlog is None:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.Again:  # its queue in ZeroMQ is full: the client is not reading
                backlog = self.backlogs[identity] = Backlog(deque())
            except zmq.ZMQError as e:  # EHOSTUNREACH: disconnected
                self._client_gone(identity, e.strerror)
                return False
        backlog.frames.append(frames)
        backlog.bytes += len(frames[-1])
        if backlog.bytes > self.config.max_client_backlog_bytes:
            self._overflow(identity, backlog)
        return True

    def _flush_backlogs(self) -> None:
        for identity, backlog in list(self.backlogs.items()):
            try:
                while backlog.frames:
                    self.sock.send_multipart(backlog.frames[0], zmq.NOBLOCK)
                    backlog.bytes -= len(backlog.frames.popleft()[-1])
            except zmq.Again:
                continue
            except zmq.ZMQError as e:
                self._client_gone(identity, e.strerror)
                continue
            del self.backlogs[identity]

    def _overflow(self, identity: bytes, backlog: Backlog) -> None:
        """A client that lets too much pile up: its requests are cancelled; each one's error event
        comes after everything already queued for it, so the client learns why once it reads."""
        flights = [(rid, f) for rid, f in self.inflight.items() if f.identity == identity and not f.overflowed]
        if flights:
            self.counters["slow_clients"] += 1
            log.warning(
                "client %s left %.1f MiB of events unread: cancelling its %d request(s)",
                identity.hex(),
                backlog.bytes / 2**20,
                len(flights),
            )
        for rid, flight in flights:
            flight.overflowed = True
            self.engine.abort(rid)

    def _watch_connections(self) -> None:
        """Cancel the requests of connections that closed. A connection's fd is only reused by a
        later one after its DISCONNECTED (or the new one's ACCEPTED) event is queued, and before
        any message of the new one: reading these events before handling messages and before
        sending keeps the two apart."""
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())
            fd = event["value"]
            for identity in {f.identity for f in self.inflight.values() if f.fd == fd and fd >= 0}:
                self._client_gone(identity, "connection closed")

    def _client_gone(self, identity: bytes, why: str) -> None:
        self.backlogs.pop(identity, None)
        for worker in self.workers:
            worker.forget_connection(identity)
        gone = [rid for rid, f in self.inflight.items() if f.identity == identity]
        if gone:
            self.counters["clients_gone"] += 1
            log.info("client %s gone (%s): cancelling %d request(s)", identity.hex(), why, len(gone))
        for rid in gone:
            self._forget(rid)
            self.engine.abort(rid)

    def _forget(self, engine_id: str) -> InFlight:
        flight = self.inflight.pop(engine_id)
        del self.by_client[(flight.identity, flight.client_id)]
        return flight

    # -- the loop ----------------------------------------------------------------------------
    def serve_forever(self) -> int:
        # SIGUSR1 too: under mpirun, SIGTERM to mpirun kills every rank at once, while SIGUSR1 is
        # forwarded to the ranks; the followers ignore it and the leader drains.
        if self.config.handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                signal.signal(sig, self._begin_drain)
        groups = f" in {self.engine.groups} groups" if self.engine.groups > 1 else ""
        print(
            f"flover serve: ready on {self.config.bind} ({self.model_name}, "
            f"{self.engine.comm.size if self.engine.comm else 1} rank(s){groups}, {self.engine.config.max_slots} "
            f"slots)",
            flush=True,
        )
        try:
            while True:
                busy = self.engine.has_unfinished()
                ready = dict(self.poller.poll(0 if busy else 100))
                if self.sock in ready:
                    self._intake()
                if self._preparing():
                    self._admit_tokenized()
                unfinished = self.engine.has_unfinished() or self._preparing()
                if self.draining and (not unfinished or time.monotonic() > self.drain_deadline):
                    self._cancel_all()
                    break
                if self.engine.has_unfinished():
                    outputs = self._step()
                    self._watch_connections()
                    self._reply(outputs)
                if self.backlogs:
                    self._flush_backlogs()
                self._periodic()
        finally:
            if self.config.handle_signals:  # exiting: a late signal must not turn a clean exit into a kill
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                    signal.signal(sig, signal.SIG_IGN)
            self.engine.shutdown()  # releases follower ranks (and stops a grammar compile in its child)
            for worker in self.workers:
                worker.close()
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(linger=EXIT_FLUSH_MS)  # the last events (a drain's cancelled finals) still go out
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()
        log.info("stopped: %s", self.counters)
        return 0

    def _step(self) -> list[RequestOutput]:
        """One engine iteration. Failures that belong to one request end that request inside the
        engine. Should the iteration itself fail (a bug), the requests in flight get an
        `internal_error` and the daemon carries on. With several ranks the job must end instead
        (the followers are inside the same iteration and cannot be brought back in step; a pipeline
        stage that went silent: StageTimeout), after every request in flight got its error."""
        try:
            outputs = self.engine.step()
            for seconds, rows in self.engine.timed_iterations():  # (with groups: every group's)
                self.metrics.iteration(seconds, rows)
            return outputs
        except Exception as e:
            log.exception("engine iteration failed; failing the %d request(s) in flight", len(self.inflight))
            code, why = protocol.INTERNAL, f"internal error: {e!r}"
            if isinstance(e, StageTimeout):
                code, why = protocol.ENGINE_UNRESPONSIVE, str(e)
            for rid in list(self.inflight):
                flight = self._forget(rid)
                if self.engine.comm is None:
                    self.engine.abort(rid)
                self.counters["errors"] += 1
                self._send(flight.identity, protocol.error_event(code, why, flight.client_id), flight.envelope)
            if self.engine.comm is not None:
                raise
            return []

    def _begin_drain(self, signum, _frame) -> None:
        if not self.draining:
            log.info(
                "%s: draining (up to %.0f s), no new requests; again to stop at once",
                signal.Signals(signum).name,
                self.config.drain_timeout,
            )
            self.draining = True
            self.drain_deadline = time.monotonic() + self.config.drain_timeout
        else:  # a second signal: cancel what is left and stop
            log.info(
                "%s again: cancelling the %d request(s) in flight", signal.Signals(signum).name, len(self.inflight)
            )
            self.drain_deadline = 0.0

    def _cancel_all(self) -> None:
        """Drain timeout: everyone still in flight gets a `cancelled` final (or, still being
        tokenized, a `shutting_down` error)."""
        for rid in [rid for worker in self.workers for rid in worker.jobs]:
            if rid in self.inflight:
                flight = self._forget(rid)
                self._send(
                    flight.identity,
                    protocol.error_event(protocol.SHUTTING_DOWN, "the server is shutting down", flight.client_id),
                    flight.envelope,
                )
        for rid in list(self.inflight):
            self.engine.abort(rid)
        while self.inflight and self.engine.has_unfinished():
            self._reply(self.engine.step())
        deadline = time.monotonic() + 1.0  # give slow readers a moment for what is queued for them
        while self.backlogs and time.monotonic() < deadline:
            self._flush_backlogs()
            time.sleep(0.01)

    def _periodic(self) -> None:
        now = time.monotonic()
        if now - self._last_keepalive >= self.config.keepalive_interval:
            self._last_keepalive = now
            waiting = {f.identity for f in self.inflight.values() if not f.envelope}  # (streams too: queued ones)
            for identity in waiting - set(self.backlogs):
                self._send(identity, {"event": "keepalive"})
        if now - self._last_stats >= self.config.stats_interval:
            self._last_stats = now
            log.info("summary: %s", {k: v for k, v in self.stats().items() if k != "metrics"})

    # -- intake ------------------------------------------------------------------------------
    def _intake(self) -> None:
        started = time.monotonic()
        budget = self.config.max_intake_seconds if self.engine.has_unfinished() else float("inf")
        for _ in range(self.config.max_messages_per_turn):
            if time.monotonic() - started > budget:
                return  # the rest waits in the socket until after the next iteration
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity, payload = frames[0].bytes, frames[-1]
            self._watch_connections()
            envelope = len(frames) == 3 and len(frames[1]) == 0  # a REQ socket's empty delimiter
            size = sum(len(f) for f in frames[1:])
            if _chosen_routing_id(payload):
                self._reject(
                    identity,
                    protocol.ProtocolError(
                        protocol.ROUTING_ID_NOT_ALLOWED,
                        "connection identities are assigned by the server: do not set ZMQ_ROUTING_ID on your socket",
                        _peek_id(payload),
                    ),
                    envelope,
                )
            elif size > self.config.max_message_bytes:
                self._reject(
                    identity,
                    protocol.ProtocolError(
                        protocol.MESSAGE_TOO_LARGE,
                        f"a message of {size} bytes exceeds the server's limit of "
                        f"{self.config.max_message_bytes} bytes",
                    ),
                    envelope,
                )
            elif len(frames) != 2 and not envelope:
                self._reject(
                    identity,
                    protocol.ProtocolError(protocol.BAD_MESSAGE, f"expected one message frame, got {len(frames) - 1}"),
                    envelope,
                )
            else:
                self._handle_safely(identity, payload, envelope)

    def _handle_safely(self, identity: bytes, payload: zmq.Frame, envelope: bool) -> None:
        """Every message gets its answer; an error carries the message's id whenever the message
        has one that can be read, whatever went wrong (a client waits on that id)."""
        try:
            self._handle(identity, payload, envelope)
        except protocol.ProtocolError as e:
            if e.request_id is None:
                e.request_id = _peek_id(payload)
            self._reject(identity, e, envelope)
        except RecursionError:
            self._reject(
                identity,
                protocol.ProtocolError(protocol.INVALID_REQUEST, "the request nests too deeply", _peek_id(payload)),
                envelope,
            )
        except Exception as e:  # never fall over on a request
            log.exception("internal error on a request")
            self._reject(
                identity,
                protocol.ProtocolError(protocol.INTERNAL, f"internal error: {type(e).__name__}", _peek_id(payload)),
                envelope,
            )

    def _reject(self, identity: bytes, error: protocol.ProtocolError, envelope: bool = False) -> None:
        self.counters["rejected"] += 1
        log.debug("rejected (%s): %s", error.code, error)
        self._send(identity, protocol.error_event(error.code, str(error), error.request_id), envelope)

    def _handle(self, identity: bytes, payload: zmq.Frame, envelope: bool) -> None:
        message = protocol.unpack(payload.bytes)
        op = message.get("op")
        if op in ("generate", "embed"):
            return self._generate(identity, message, envelope, _source_fd(payload), _user_id(payload))
        rid = protocol.echo_id(message)
        if op == "cancel":
            engine_id = self.by_client.get((identity, rid))
            if engine_id is None:
                raise protocol.ProtocolError(
                    protocol.UNKNOWN_ID, f"no request {rid!r} of this connection is in flight", rid
                )
            if not any(worker.cancel(engine_id) for worker in self.workers):  # (queued once prepared, then cancelled)
                self.engine.abort(engine_id)  # its `cancelled` final comes with the next iteration
        elif op == "health":
            c, e = self.config, self.engine
            self._send(
                identity,
                {
                    "event": "health",
                    "id": rid,
                    "status": "draining" if self.draining else "ok",
                    "model": self.model_name,
                    "max_message_bytes": c.max_message_bytes,
                    "max_seq_len": e.max_seq_len,
                    "max_slots": e.config.max_slots,
                    "capabilities": e.capabilities,
                },
                envelope,
            )
        elif op == "stats":
            self._send(identity, {"event": "stats", "id": rid, **self.stats()}, envelope)
        else:
            raise protocol.ProtocolError(
                protocol.UNKNOWN_OP, f"unknown op {op!r}; one of {', '.join(protocol.OPS)}", rid
            )

    def _generate(self, identity: bytes, message: dict, envelope: bool, fd: int, user: str | None) -> None:
        """A generate or an embed message: checked, then tokenized off the loop (or queued at once)."""
        if message.get("op") == "embed":
            req = protocol.parse_embed(message)
            refused = self.engine.embeddings_refused
            if refused is not None:
                raise protocol.ProtocolError(protocol.INVALID_REQUEST, refused, req.id)
        else:
            req = protocol.parse_generate(message)
        stream = getattr(req, "stream", False)  # (an embed op never streams)
        if stream and envelope:
            raise protocol.ProtocolError(
                protocol.INVALID_REQUEST,
                "a REQ socket takes one reply per request: send `stream: false`, or use a DEALER socket to stream",
                req.id,
            )
        if self.draining:
            raise protocol.ProtocolError(protocol.SHUTTING_DOWN, "the server is shutting down", req.id)
        if (identity, req.id) in self.by_client:
            raise protocol.ProtocolError(protocol.DUPLICATE_ID, f"request {req.id!r} is already in flight", req.id)
        # A prompt cancelled in a lane frees its place at once (the lane answers it when it gets
        # there); the lanes hold at most max_waiting of those besides, each with its message.
        wanted, most = sum(w.wanted() for w in self.workers), self.config.max_waiting
        if self._preparing() - wanted >= most or not self.engine.can_accept(most - wanted):
            raise protocol.ProtocolError(
                protocol.OVERLOADED, f"{self.config.max_waiting} requests are already waiting; retry later", req.id
            )
        engine_id = str(next(self._engine_ids))  # ours: client ids may repeat across connections
        flight = InFlight(identity, req.id, stream, envelope, fd, user, arrived=time.perf_counter())
        if isinstance(req, protocol.EmbedRequest):
            if isinstance(req.input, str):
                self.tokenizing.submit(Job(identity, engine_id, req))
            else:
                self._queue(engine_id, flight, req, None)
        elif req.params.structured is not None:
            self.compiling.submit(Job(identity, engine_id, req))  # grammar work: off the loop, apart
        elif req.messages is not None:
            self.rendering.submit(Job(identity, engine_id, req))  # a template's work: off the loop, apart
        elif isinstance(req.prompt, str):
            self.tokenizing.submit(Job(identity, engine_id, req))  # tokenizer work: off the loop
        else:
            self._queue(engine_id, flight, req, None)  # token ids: checked at once
        self.inflight[engine_id] = flight
        self.by_client[(identity, req.id)] = engine_id
        self.counters["requests"] += 1

    def _preparing(self) -> int:
        """Requests being tokenized or compiled."""
        return sum(len(worker) for worker in self.workers)

    def _prepare(self, req: protocol.GenerateRequest):
        """On the tokenizing worker: the prompt's tokens (text or chat), and the request's
        structure compiled (cached, so that queuing it on the loop finds it ready)."""
        if isinstance(req, protocol.EmbedRequest):
            return self.engine.input_ids(req.input, req.truncate_prompt_tokens, req.document)
        if req.params.structured is not None:
            self.engine.grammars.compile(req.params.structured)
        if req.messages is not None or isinstance(req.prompt, str):
            return self.engine.tokenize(req.prompt, req.messages, req.tools, req.chat_template_kwargs)
        return None

    def _queue(self, engine_id: str, flight: InFlight, req: protocol.GenerateRequest, tokenized) -> None:
        if isinstance(req, protocol.EmbedRequest):
            given = RequestInput(
                req.input,
                request_id=engine_id,
                cache_salt=flight.user,
                arrival_time=flight.arrived,
                tokenized=tokenized,
                embed=EmbedParams(req.dimensions, req.truncate_prompt_tokens, req.document),
            )
            try:
                request = self.engine.make_request(given)
            except (ValueError, TypeError) as e:
                raise _refusal(e, req.id) from None
            self.engine.enqueue(request)
            return
        try:
            # With CURVE, each client key is a prefix-cache partition of its own (prefix_cache.py).
            request = self.engine.make_request(
                RequestInput(
                    req.prompt,
                    req.params,
                    engine_id,
                    stream=req.stream,
                    messages=req.messages,
                    cache_salt=flight.user,
                    arrival_time=flight.arrived,
                    tokenized=tokenized,
                )
            )
        except (ValueError, TypeError) as e:
            raise _refusal(e, req.id) from None
        self.engine.enqueue(request)

    def _admit_tokenized(self) -> None:
        """Queue the requests whose tokenizing ended (or answer the error it found)."""
        for job in [job for worker in self.workers for job in worker.finished()]:
            flight = self.inflight.get(job.engine_id)
            if flight is None:
                continue  # its client is gone
            try:
                if job.error is not None:
                    raise job.error
                self._queue(job.engine_id, flight, job.payload, job.result)
            except Exception as e:  # never fall over on a request
                self._forget(job.engine_id)
                self.counters["requests"] -= 1  # counted when it arrived; a refusal counts as rejected
                refusal = e if isinstance(e, protocol.ProtocolError) else _refusal(e, flight.client_id)
                self._reject(flight.identity, refusal, flight.envelope)
                continue
            if job.cancelled:
                self.engine.abort(job.engine_id)

    # -- replies -----------------------------------------------------------------------------
    def _reply(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            flight = self.inflight.get(out.request_id)
            if flight is None:
                continue  # its client is gone
            if out.new_token_ids:
                if flight.last_token_at is not None:
                    self.metrics.token_gap(now - flight.last_token_at)
                flight.last_token_at = now
            if flight.stream and not flight.overflowed and (out.new_token_ids or out.text_delta):
                if not self._send(flight.identity, protocol.token_event(flight.client_id, out)):
                    continue
                flight.tokens_sent += len(out.new_token_ids)
            if not out.finished:
                continue
            self._forget(out.request_id)
            if flight.overflowed:
                self.counters["cancelled"] += 1
                self._send(
                    flight.identity,
                    protocol.error_event(
                        protocol.SLOW_CLIENT,
                        f"cancelled after {flight.tokens_sent} tokens: more than "
                        f"{self.config.max_client_backlog_bytes} bytes of events were waiting to be read",
                        flight.client_id,
                    ),
                    flight.envelope,
                )
            elif out.finish_reason == "error":
                self.counters["errors"] += 1
                self._send(
                    flight.identity,
                    protocol.error_event(
                        out.error_code or protocol.INTERNAL, out.error or "internal error", flight.client_id
                    ),
                    flight.envelope,
                )
            else:
                self._send(flight.identity, protocol.final_event(flight.client_id, out, flight.stream), flight.envelope)
                self._account(flight, out)

    def _account(self, flight: InFlight, out: RequestOutput) -> None:
        c = self.counters
        c["completed" if out.finish_reason != "cancelled" else "cancelled"] += 1
        c["tokens_out"] += len(out.token_ids)
        t = out.timings
        self.metrics.request_finished(out.finish_reason, len(out.prompt_token_ids), len(out.token_ids), t)
        ms = lambda v: "-" if v is None else f"{1000 * v:.1f}"  # noqa: E731
        log.info(
            "request id=%r client=%s%s%s in=%d out=%d queue_ms=%s ttft_ms=%s tpot_ms=%s finish=%s",
            flight.client_id,
            flight.identity.hex(),
            f" key={flight.user}" if flight.user else "",
            f" group={out.group}" if out.group is not None else "",
            len(out.prompt_token_ids),
            len(out.token_ids),
            ms(t["queue_time"]),
            ms(t["ttft"]),
            ms(t["tpot"]),
            out.finish_reason,
        )

    def stats(self) -> dict:
        e = self.engine.stats()
        return {
            "in_flight": len(self.inflight),
            "running": e.running,
            "waiting": e.waiting,
            "tokenizing": self._preparing(),
            "slots_used": e.running,
            "slots_total": e.slots_total,
            "kv_bytes": e.kv_bytes,
            "kv_bytes_per_token": e.kv_bytes_per_token,
            "kv_tokens": e.kv_tokens,
            "kv_use": e.kv_use,
            "iterations": e.iterations,
            "uptime_s": time.time() - self.started,
            "draining": self.draining,
            "shuffle_moves": e.shuffle_moves,
            "shuffle_bytes": e.shuffle_bytes,
            "draft_tokens": e.draft_tokens,
            "accepted_tokens": e.accepted_tokens,
            "prefix_cache": e.prefix_cache,
            "native_kernels": e.native_kernels,
            "groups": e.groups,
            "expert_load": e.expert_load,
            "pipeline": e.pipeline,
            **self.counters,
            "metrics": self.metrics.snapshot(),
        }


def _refusal(e: Exception, request_id) -> protocol.ProtocolError:
    """What a client is told of a request the engine would not take (tokenizing included)."""
    if isinstance(e, PromptTooLong):
        return protocol.ProtocolError(protocol.PROMPT_TOO_LONG, str(e), request_id)
    if isinstance(e, (ValueError, TypeError)):
        return protocol.ProtocolError(protocol.INVALID_REQUEST, str(e), request_id)
    log.error("internal error on a request", exc_info=e)
    return protocol.ProtocolError(protocol.INTERNAL, f"internal error: {e!r}", request_id)


def _peek_id(payload: zmq.Frame):
    """The id of a message that could not be taken, to put on its error: read leniently (integer
    map keys, which the protocol refuses, are allowed here)."""
    return protocol.peek_id(payload.bytes)


def _chosen_routing_id(payload: zmq.Frame) -> bool:
    """The peer announced a routing id of its own (ZMTP metadata). (libzmq reads the property
    as a C string: an id starting with a zero byte reads as empty, and looks generated.)"""
    try:
        return bool(payload.get("Identity"))
    except zmq.ZMQError:  # inproc: no metadata
        return False


def _source_fd(payload: zmq.Frame) -> int:
    try:
        return payload.get(zmq.SRCFD)
    except zmq.ZMQError:
        return -1


def _user_id(payload: zmq.Frame) -> str | None:
    """The authenticated CURVE key (ZAP User-Id) of the connection a frame came on, if any."""
    try:
        return payload.get("User-Id") or None
    except zmq.ZMQError:  # no ZAP handler: no user id
        return None


def _is_local(bind: str) -> bool:
    if bind.startswith(("ipc://", "inproc://")):
        return True
    host = bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
