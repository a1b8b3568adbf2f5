"""`flover serve`: rank 0's ZeroMQ loop around the engine.

One thread owns the socket and the engine. Each turn of the loop reads every waiting message,
answers the cheap ones (health, stats, errors) at once, queues generate requests, and runs one
engine iteration if anything is in flight: a request that arrives while others generate joins the
running batch at the next iteration. Idle, the loop blocks in a socket poll (~0% CPU).

Every generate request gets exactly one `final` or one `error` event. A client that disappears
(its socket closes or its process dies) becomes unroutable; the first send to it fails
(ROUTER_MANDATORY) and its requests are cancelled. Clients with only non-streaming requests in
flight get a `keepalive` event every second so that this is noticed within a second.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from flover.engine import Engine, PromptTooLong
from flover.request import RequestOutput
from flover.server import protocol as p

log = logging.getLogger("flover.serve")


@dataclass
class ServeConfig:
    bind: str = "tcp://127.0.0.1:5555"
    max_waiting: int = 256  # queued requests beyond the slots; more get `overloaded`
    max_message_bytes: int = 1 << 20  # larger frames make ZeroMQ drop the sender's connection
    drain_timeout: float = 30.0  # seconds to finish in-flight requests after SIGTERM/SIGINT
    stats_interval: float = 60.0  # seconds between summary log lines
    keepalive_interval: float = 1.0
    max_messages_per_turn: int = 1000  # a flood cannot starve the running requests
    curve_secret_key: str | None = None  # server certificate (zmq.auth format), enables CURVE
    curve_allowed_clients: str | None = None  # directory of allowed client public certificates
    handle_signals: bool = True  # SIGTERM/SIGINT/SIGUSR1 start the drain (main thread only)


@dataclass
class InFlight:
    identity: bytes
    client_id: str
    stream: bool


class Daemon:
    def __init__(self, engine: Engine, config: ServeConfig, model_name: str = ""):
        self.engine, self.config, self.model_name = engine, config, model_name
        self.ctx = zmq.Context()
        self.auth = None  # ZAP authenticator thread when CURVE is on
        self.sock = self._socket()
        self.inflight: dict[str, InFlight] = {}  # engine request id -> who asked
        self.draining = False
        self.drain_deadline = float("inf")
        self.started = time.time()
        self.counters = {"requests": 0, "completed": 0, "errors": 0, "cancelled": 0, "tokens_out": 0,
                         "rejected": 0, "clients_gone": 0}
        self._last_keepalive = self._last_stats = time.monotonic()

    # -- socket ----------------------------------------------------------------------------
    def _socket(self) -> zmq.Socket:
        c = self.config
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable peer -> error, not a silent drop
        sock.setsockopt(zmq.MAXMSGSIZE, c.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RCVHWM, 10000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # detect dead TCP peers in ~3 s
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        if c.curve_secret_key:
            self._enable_curve(sock)
        elif not _is_local(c.bind):
            log.warning("binding %s without CURVE: anyone who can reach it can use the model", c.bind)
        sock.bind(c.bind)
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
        self.auth.configure_curve(domain="*", location=allowed)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True

    def _send(self, identity: bytes, event: dict) -> bool:
        """False (and the client's requests are cancelled) if the client is gone or not reading."""
        try:
            self.sock.send_multipart([identity, p.pack(event)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH: disconnected; EAGAIN: not reading for 10000 events
            self._client_gone(identity, e.strerror)
            return False

    def _client_gone(self, identity: bytes, why: str) -> None:
        gone = [rid for rid, f in self.inflight.items() if f.identity == identity]
        if gone:
            self.counters["clients_gone"] += 1
            log.info("client %s gone (%s): cancelling %d request(s)", identity.hex(), why, len(gone))
        for rid in gone:
            del self.inflight[rid]
            self.engine.abort(rid)

    # -- the loop ----------------------------------------------------------------------------
    def serve_forever(self) -> int:
        # SIGUSR1 too: under mpirun, SIGTERM to mpirun kills every rank at once, while SIGUSR1 is
        # forwarded to the ranks; the followers ignore it and the leader drains.
        if self.config.handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
                signal.signal(sig, self._begin_drain)
        print(f"flover serve: ready on {self.config.bind} ({self.model_name}, "
              f"{self.engine.comm.size if self.engine.comm else 1} rank(s), {self.engine.config.max_slots} slots)",
              flush=True)
        try:
            while True:
                busy = self.engine.has_unfinished()
                if self.sock.poll(0 if busy else 100, zmq.POLLIN):
                    self._intake()
                if self.draining and (not self.engine.has_unfinished() or time.monotonic() > self.drain_deadline):
                    self._cancel_all()
                    break
                if self.engine.has_unfinished():
                    self._reply(self._step())
                self._periodic()
        finally:
            self.engine.shutdown()  # releases follower ranks
            self.sock.close(0)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()
        log.info("stopped: %s", self.counters)
        return 0

    def _step(self) -> list[RequestOutput]:
        """One engine iteration. Should it fail (a bug), the requests in flight get an
        `internal_error` and the daemon carries on. With several ranks the job must end instead:
        the followers are inside the same iteration and cannot be brought back in step."""
        try:
            return self.engine.step()
        except Exception as e:
            if self.engine.comm is not None:
                raise
            log.exception("engine iteration failed; failing the %d request(s) in flight", len(self.inflight))
            for rid, flight in list(self.inflight.items()):
                del self.inflight[rid]
                self.engine.abort(rid)
                self.counters["errors"] += 1
                self._send(flight.identity, p.error_event(p.INTERNAL, f"internal error: {e!r}", flight.client_id))
            return []

    def _begin_drain(self, signum, _frame) -> None:
        if not self.draining:
            log.info("%s: draining (up to %.0f s), no new requests", signal.Signals(signum).name,
                     self.config.drain_timeout)
            self.draining = True
            self.drain_deadline = time.monotonic() + self.config.drain_timeout

    def _cancel_all(self) -> None:
        """Drain timeout: everyone still in flight gets a `cancelled` final."""
        for rid in list(self.inflight):
            self.engine.abort(rid)
        while self.inflight and self.engine.has_unfinished():
            self._reply(self.engine.step())

    def _periodic(self) -> None:
        now = time.monotonic()
        if now - self._last_keepalive >= self.config.keepalive_interval:
            self._last_keepalive = now
            for identity in {f.identity for f in self.inflight.values() if not f.stream}:
                self._send(identity, {"event": "keepalive"})
        if now - self._last_stats >= self.config.stats_interval:
            self._last_stats = now
            log.info("summary: %s", self.stats())

    # -- intake ------------------------------------------------------------------------------
    def _intake(self) -> None:
        for _ in range(self.config.max_messages_per_turn):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, payload = frames[0], frames[-1]
            if len(frames) not in (2, 3) or (len(frames) == 3 and frames[1]):
                self._reject(identity, p.ProtocolError(p.BAD_MESSAGE, "expected one message frame"))
                continue
            try:
                self._handle(identity, payload)
            except p.ProtocolError as e:
                self._reject(identity, e)
            except Exception as e:  # never fall over on a request
                log.exception("internal error on a request")
                self._reject(identity, p.ProtocolError(p.INTERNAL, f"internal error: {e!r}"))

    def _reject(self, identity: bytes, error: p.ProtocolError) -> None:
        self.counters["rejected"] += 1
        log.debug("rejected (%s): %s", error.code, error)
        self._send(identity, p.error_event(error.code, str(error), error.request_id))

    def _handle(self, identity: bytes, payload: bytes) -> None:
        message = p.unpack(payload)
        op = message.get("op")
        if op == "generate":
            return self._generate(identity, message)
        rid = p.request_id_of(message)
        if op == "cancel":
            key = self._engine_id(identity, rid) if rid is not None else None
            if key not in self.inflight:
                raise p.ProtocolError(p.UNKNOWN_ID, f"no request {rid!r} of yours is in flight", rid)
            self.engine.abort(key)  # its `cancelled` final comes with the next iteration
        elif op == "health":
            status = "draining" if self.draining else "ok"
            self._send(identity, {"event": "health", "id": rid, "status": status, "model": self.model_name})
        elif op == "stats":
            self._send(identity, {"event": "stats", "id": rid, **self.stats()})
        else:
            raise p.ProtocolError(p.UNKNOWN_OP, f"unknown op {op!r}; one of {', '.join(p.OPS)}", rid)

    @staticmethod
    def _engine_id(identity: bytes, rid: str) -> str:
        return f"{identity.hex()}/{rid}"  # unique across clients

    def _generate(self, identity: bytes, message: dict) -> None:
        req = p.parse_generate(message)
        if self.draining:
            raise p.ProtocolError(p.SHUTTING_DOWN, "the server is shutting down", req.id)
        key = self._engine_id(identity, req.id)
        if key in self.inflight:
            raise p.ProtocolError(p.DUPLICATE_ID, f"request {req.id!r} is already in flight", req.id)
        if len(self.engine.scheduler.waiting) >= self.config.max_waiting:
            raise p.ProtocolError(p.OVERLOADED, f"{self.config.max_waiting} requests are already waiting; "
                                                "retry later", req.id)
        engine = self.engine
        try:
            request = engine.make_request(req.prompt, req.params, key, stream=req.stream, messages=req.messages)
        except PromptTooLong as e:
            raise p.ProtocolError(p.PROMPT_TOO_LONG, str(e), req.id) from None
        except (ValueError, TypeError) as e:
            raise p.ProtocolError(p.INVALID_REQUEST, str(e), req.id) from None
        engine.enqueue(request)
        self.inflight[key] = InFlight(identity, req.id, req.stream)
        self.counters["requests"] += 1

    # -- replies -----------------------------------------------------------------------------
    def _reply(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            flight = self.inflight.get(out.request_id)
            if flight is None:
                continue  # its client is gone
            if flight.stream and (out.new_token_ids or out.text_delta):
                if not self._send(flight.identity, p.token_event(flight.client_id, out.new_token_ids, out.text_delta)):
                    continue
            if out.finished:
                del self.inflight[out.request_id]
                self._send(flight.identity, p.final_event(flight.client_id, out, flight.stream))
                self._account(flight, out)

    def _account(self, flight: InFlight, out: RequestOutput) -> None:
        c = self.counters
        c["completed" if out.finish_reason != "cancelled" else "cancelled"] += 1
        c["tokens_out"] += len(out.token_ids)
        t = out.timings
        ms = lambda v: "-" if v is None else f"{1000 * v:.1f}"  # noqa: E731
        log.info("request id=%s client=%s in=%d out=%d queue_ms=%s ttft_ms=%s tpot_ms=%s finish=%s",
                 flight.client_id, flight.identity.hex()[:8], len(out.prompt_token_ids), len(out.token_ids),
                 ms(t["queue_time"]), ms(t["ttft"]), ms(t["tpot"]), out.finish_reason)

    def stats(self) -> dict:
        e = self.engine
        running = e.scheduler.running  # finished requests still in a slot until the next step do not count
        kv_tokens = sum(r.num_computed + max(0, len(r.output_token_ids) - 1) for r in running)
        return {"in_flight": len(self.inflight), "running": len(running), "waiting": len(e.scheduler.waiting),
                "slots_used": len(running), "slots_total": e.config.max_slots, "kv_bytes": e.buffer.nbytes,
                "kv_tokens": kv_tokens, "kv_use": kv_tokens / (e.config.max_slots * e.max_seq_len),
                "iterations": e.iterations, "uptime_s": time.time() - self.started, "draining": self.draining,
                **self.counters}


def _is_local(bind: str) -> bool:
    if bind.startswith(("ipc://", "inproc://")):
        return True
    host = bind.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
