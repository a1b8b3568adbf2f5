"""The OpenAI-compatible HTTP front (`flover serve --http HOST:PORT`).

It runs in its own process and is one more client of the daemon's ZeroMQ socket (`AsyncClient`),
the way vLLM's API server talks to its engine core: JSON, server-sent events and HTTP never take
time from the engine loop. A request goes: HTTP body -> `openai_api.plan` (one daemon request
per choice) -> the socket -> the engine -> token/final events -> chunks or one JSON answer.

    python -m flover.server.http_api --engine tcp://127.0.0.1:5555 --listen 127.0.0.1:8000 --model M

(`flover serve --http` starts it and stops it with the daemon; the API key comes in the
environment variable FLOVER_API_KEY so that it never shows in a process list; so do the CURVE
keys when the socket uses CURVE: FLOVER_CURVE_SERVER_KEY, _PUBLIC_KEY, _SECRET_KEY, z85.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from flover.client import AsyncClient, FloverError
from flover.protocol import MAX_MESSAGE_BYTES
from flover.server import openai_api as oa
from flover.server.http_front import CURVE_ENV, HttpLimits, parse_listen
from flover.server.http_guard import guarded_protocol, usable_connections
from flover.server.prometheus import render
from flover.hardware import background_thread
from flover.tools import syntax_of

log = logging.getLogger("flover.http")


def error_response(e: oa.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def from_daemon(e: FloverError) -> oa.ApiError:
    return oa.ApiError(oa.STATUS.get(e.code, 500), e.message, e.code)


def as_api_error(e: BaseException) -> oa.ApiError:
    """Whatever ended a request, as the error its client gets: a bug is a 500, logged here once."""
    if isinstance(e, oa.ApiError):
        return e
    if isinstance(e, FloverError):
        return from_daemon(e)
    log.error("internal error on a request", exc_info=e)
    return oa.ApiError(500, f"internal error: {type(e).__name__}", "internal_error")


async def wait_watching(request: Request, tasks) -> bool:
    """Wait for the first of `tasks` to finish (or fail) while the client stays connected; False
    as soon as it hung up (polled every 50 ms), so that a gone client's requests leave the queue."""
    while True:
        done, _ = await asyncio.wait(tasks, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
        if done:
            return True
        if await request.is_disconnected():
            return False


class Front:
    """The app's state: one AsyncClient to the daemon, the tokenizer, the served name."""

    def __init__(self, engine_addr: str, model_name: str, tokenizer, api_key: str | None,
                 parent_pid: int | None = None, curve: tuple[bytes, bytes, bytes] | None = None,
                 max_body_bytes: int = MAX_MESSAGE_BYTES):
        """`parent_pid`: the daemon that started this front; the front stops when it is gone
        (also when it was killed and could not stop the front itself). `curve`: (the daemon's
        public key, this front's public and secret keys) when the socket uses CURVE.
        `max_body_bytes`: larger request bodies are refused (the daemon's message bound)."""
        self.engine_addr, self.model_name, self.tokenizer, self.api_key = engine_addr, model_name, tokenizer, api_key
        self.parent_pid, self.curve, self.max_body_bytes = parent_pid, curve, max_body_bytes
        self.client: AsyncClient | None = None
        self.max_model_len: int | None = None
        # how this model writes tool calls (from its chat template: flover/tools.py)
        self.tool_syntax = syntax_of(tokenizer.chat_template_source if tokenizer is not None else None)
        self._background: set[asyncio.Task] = set()
        self.streams: set[asyncio.Queue] = set()  # the event queues of the streamed answers in flight
        # Tokenizing and rendering chat templates cost CPU in proportion to the text: they run
        # here, never on the event loop (the `tokenizers` library releases the GIL while it works).
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="flover-tokenize",
                                       initializer=background_thread)
        # Request bodies are parsed one at a time: a flood of large bodies takes at most one core
        # from the engine (two parsing at once doubled the gaps in a running stream).
        self._bodies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flover-body",
                                          initializer=background_thread)

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    async def parse_off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._bodies, fn, *args)

    def end_streams(self, why: str) -> None:
        """The front is stopping: every streamed answer in flight ends with an error event now (a
        client must never read a cut answer as a finished one)."""
        for events in self.streams:
            events.put_nowait((None, oa.ApiError(503, why, "shutting_down")))

    def cancel(self, rids) -> None:
        """Fire-and-forget cancels (also from a generator being torn down by a disconnect)."""
        for rid in rids:
            task = asyncio.get_running_loop().create_task(self.client.cancel(rid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def health(self) -> dict:
        health = await self.client.health(timeout=2.0)
        self.max_model_len = health.get("max_seq_len", self.max_model_len)
        return health


class RequireKey:
    """'Authorization: Bearer KEY' on every path but /health. Plain ASGI on purpose: Starlette's
    BaseHTTPMiddleware wraps `receive` so that handlers no longer see a client disconnect."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                refused = oa.ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", "invalid_api_key")
                await error_response(refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(front: Front) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        curve = front.curve
        front.client = AsyncClient(front.engine_addr, curve_server_key=curve[0] if curve else None,
                                   curve_client_cert=curve[1:] if curve else None)
        watch = asyncio.ensure_future(_stop_when_orphaned(front.parent_pid)) if front.parent_pid else None
        try:
            yield
        finally:
            if watch is not None:
                watch.cancel()
            await front.client.close()

    app = FastAPI(title="flover", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # a bug: OpenAI's error shape, never a hang
        return error_response(as_api_error(e))

    if front.api_key:
        app.add_middleware(RequireKey, key=front.api_key)

    @app.get("/health")
    async def health():
        try:
            status = (await front.health())["status"]
        except (FloverError, asyncio.TimeoutError):
            status = "unreachable"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        try:
            stats = await front.client.stats(timeout=5.0)
        except (FloverError, asyncio.TimeoutError) as e:
            return error_response(oa.ApiError(503, f"the engine did not answer ({e})", "unavailable"))
        return Response(render(stats, front.model_name), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        await context_length()
        return {"object": "list", "data": [{"id": front.model_name, "object": "model", "created": 0,
                                            "owned_by": "flover", "max_model_len": front.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            body = await _json(request, front.max_body_bytes, front.parse_off_loop, TOKENIZE_FIELDS)
            limit = await context_length()
            if "messages" in body:
                ids = await encode(await render_chat(oa.chat_messages(body["messages"])), limit, "messages", False)
            elif isinstance(body.get("prompt"), str):
                special = oa._boolean(body, "add_special_tokens")
                ids = await encode(body["prompt"], limit, "prompt", True if special is None else special)
            else:
                raise oa.ApiError(400, "expected prompt (a string) or messages", param="prompt")
        except oa.ApiError as e:
            return error_response(e)
        answer = {"tokens": ids, "count": len(ids), "max_model_len": front.max_model_len}
        return Response(await front.off_loop(json.dumps, answer), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = await _json(request, front.max_body_bytes, front.parse_off_loop, {"model", "tokens"})
            if front.tokenizer is None:
                raise oa.ApiError(400, "this checkpoint has no tokenizer", param="tokens")
            ids = body.get("tokens")
            vocab = front.tokenizer.vocab_size
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                    for t in ids):
                raise oa.ApiError(400, f"tokens: expected a list of token ids in [0, {vocab})", param="tokens")
        except oa.ApiError as e:
            return error_response(e)
        return {"prompt": await front.off_loop(front.tokenizer.decode, ids)}

    async def context_length() -> int | None:
        if front.max_model_len is None:
            with contextlib.suppress(FloverError, asyncio.TimeoutError):
                await front.health()
        return front.max_model_len

    async def encode(text: str, limit: int | None, param: str, special: bool = True) -> list[int]:
        """Tokenize off the loop, refusing first (like the daemon) a text too long to fit any context."""
        if front.tokenizer is None:
            raise oa.ApiError(400, f"{param}: this checkpoint has no tokenizer; send token ids", param=param)
        if limit is not None and front.tokenizer.cannot_fit(text, limit):
            raise oa.ApiError(400, f"{param}: too long for the context of {limit} tokens", "prompt_too_long", param)
        return await front.off_loop(front.tokenizer.encode, text, special)

    async def render_chat(messages: list[dict]) -> str:
        """The chat template, off the loop (a template may loop over thousands of messages)."""
        if front.tokenizer is None:
            raise oa.ApiError(400, "messages: this checkpoint has no tokenizer", param="messages")
        try:
            return await front.off_loop(front.tokenizer.render_chat, messages)
        except ValueError as e:  # no chat template, a template error
            raise oa.ApiError(400, str(e), param="messages") from None

    async def tokenize_echoed(plan: oa.Plan) -> None:
        """`echo`: the answer lists the prompt's tokens, so the prompt is tokenized here (the ids
        the daemon then runs are the ones listed) and an id prompt's text is decoded."""
        limit = await context_length()
        for choice in plan.choices:
            if "prompt" in choice.source:
                choice.source = {"input_ids": await encode(choice.source["prompt"], limit, "prompt")}
            elif front.tokenizer is not None:
                ids, vocab = choice.source["input_ids"], front.tokenizer.vocab_size
                if not all(0 <= t < vocab for t in ids):
                    raise oa.ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
                choice.echo = await front.off_loop(front.tokenizer.decode, ids)
            else:
                choice.echo = ""

    def token_bytes(token_id: int) -> bytes:
        return front.tokenizer.token_bytes(token_id) if front.tokenizer is not None else f"token_id:{token_id}".encode()

    async def generate(request: Request, kind: str):
        try:
            body = await _json(request, front.max_body_bytes, front.parse_off_loop, oa.NEUTRAL)
            plan = await front.parse_off_loop(oa.plan, body, kind, front.model_name, log.warning, front.tool_syntax)
            if plan.echo:  # (chats go to the daemon as messages: it renders and bounds them)
                await tokenize_echoed(plan)
        except oa.ApiError as e:
            return error_response(e)
        rids = [f"http-{uuid.uuid4().hex[:12]}-{c.index}" for c in plan.choices]
        if plan.stream:
            return await stream(request, plan, rids)
        tasks = [asyncio.ensure_future(front.client.generate(**c.source, request_id=rid, **c.params))
                 for c, rid in zip(plan.choices, rids)]
        try:
            while True:
                failed = [t for t in tasks if t.done() and t.exception() is not None]
                if failed:
                    raise failed[0].exception()
                pending = [t for t in tasks if not t.done()]
                if not pending:
                    return oa.response(plan, front.model_name, [t.result() for t in tasks], token_bytes)
                if not await wait_watching(request, pending):  # the client left: free its slots
                    return JSONResponse({}, status_code=499)  # nobody reads it
        except Exception as e:  # the daemon's refusal, or anything else: this request ends here
            return error_response(as_api_error(e))
        finally:
            unfinished = [rid for t, rid in zip(tasks, rids) if not t.done() or t.cancelled() or t.exception()]
            for t in tasks:
                t.cancel()
            front.cancel(unfinished)

    async def stream(request: Request, plan: oa.Plan, rids: list[str]):
        events: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, rid: str, choice: oa.Choice) -> None:
            try:
                async for event in front.client.stream(**choice.source, request_id=rid, **choice.params):
                    events.put_nowait((index, event))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # whatever ends a pump reaches the handler: it never waits forever
                events.put_nowait((index, as_api_error(e)))

        pumps = [asyncio.ensure_future(pump(c.index, rid, c)) for c, rid in zip(plan.choices, rids)]
        finished: set[int] = set()
        front.streams.add(events)

        def stop() -> None:
            front.streams.discard(events)
            for task in pumps:
                task.cancel()
            front.cancel([rid for i, rid in enumerate(rids) if i not in finished])

        # An error before any token is still an HTTP status; a client that hangs up while its
        # requests wait in the queue takes them out of it.
        waiting = asyncio.ensure_future(events.get())
        try:
            connected = await wait_watching(request, [waiting])
        finally:
            if not waiting.done():
                waiting.cancel()
        if not connected:
            stop()
            return JSONResponse({}, status_code=499)  # nobody reads it
        first = waiting.result()
        if isinstance(first[1], oa.ApiError):
            finished.add(first[0])
            stop()
            return error_response(first[1])

        async def body():
            started: set[int] = set()
            offsets = [0] * len(rids)  # characters of token text streamed per choice (completions' text_offset)
            held = [""] * len(rids)  # with tools: each choice's text, sent once its calls are known
            finals: list[dict | None] = [None] * len(rids)
            item = first
            try:
                while True:
                    index, event = item
                    if isinstance(event, oa.ApiError):  # (index None: the front is stopping)
                        finished.add(index)
                        yield _sse(event.body())
                        break
                    is_first = index not in started
                    if event["event"] == "token" and plan.tool_syntax is not None:
                        held[index] += event.get("text") or ""  # with tools: sent once its calls are known
                    elif event["event"] == "token":
                        text, logprobs = oa.stream_piece(plan, plan.choices[index], event, is_first, offsets[index],
                                                         token_bytes)
                        if text or logprobs or is_first:
                            yield _sse(oa.chunk(plan, front.model_name, index, text, None, is_first, logprobs))
                            started.add(index)
                            if logprobs and "tokens" in logprobs:  # offsets count token texts, as the answer's
                                offsets[index] += sum(map(len, logprobs["tokens"]))
                    else:  # the final: finish_reason in a chunk of its own, after every token
                        if plan.tool_syntax is not None:  # the held text, as content or calls
                            pieces = oa.tool_call_chunks(plan, front.model_name, index, held[index],
                                                         event["finish_reason"])
                        else:
                            pieces = [oa.chunk(plan, front.model_name, index, None, None, first=True)] \
                                if plan.kind == "chat" and is_first else []
                            pieces.append(oa.chunk(plan, front.model_name, index, None, event["finish_reason"],
                                                   first=is_first and plan.kind != "chat"))
                        for piece in pieces:
                            yield _sse(piece)
                        started.add(index)
                        finished.add(index)
                        finals[index] = event
                        if len(finished) == len(rids):
                            if plan.include_usage:
                                yield _sse(oa.usage_chunk(plan, front.model_name, finals))
                            break
                    item = await events.get()
                yield "data: [DONE]\n\n"
            finally:  # also when the client disconnects: its requests are cancelled
                stop()

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def _server(config, front: Front):
    """uvicorn's Server, whose stop (SIGTERM, SIGINT, or the daemon gone) first ends every
    streamed answer with an error event; its graceful shutdown then lets them go out."""
    import uvicorn

    class StreamEndingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                front.end_streams("the server is shutting down; this answer is incomplete")
            super().handle_exit(sig, frame)

    return StreamEndingServer(config)


async def _stop_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(0.5)
    log.info("the daemon that started this front is gone; stopping")
    os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens"}


async def _json(request: Request, limit: int, off_loop, known: set[str]) -> dict:
    """The body as a JSON object, read up to `limit` bytes: a larger one is refused (413) before it
    is buffered, whether it declares its length or streams chunks. Parsed and checked by
    `off_loop` (one worker thread): a megabyte body costs the event loop nothing but the GIL
    while `json` parses it. Fields not in `known` are kept as null (never read: warned about,
    not walked)."""
    too_large = oa.ApiError(413, f"the request body is larger than {limit} bytes (the server's --max-message-bytes)",
                            "message_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    raw, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        raw.append(chunk)
    return await off_loop(_parse_body, b"".join(raw), known)


def _parse_body(raw: bytes, known: set[str]) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise oa.ApiError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise oa.ApiError(400, f"the request body nests deeper than {oa.MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise oa.ApiError(400, "the request body must be a JSON object")
    for key in body.keys() - known:
        body[key] = None
    oa.check_json_values(body)
    return body


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from flover.models import open_checkpoint
    from flover.models.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description="flover's OpenAI-compatible HTTP front")
    ap.add_argument("--engine", required=True, help="the daemon's ZeroMQ address")
    ap.add_argument("--listen", default="127.0.0.1:8000")
    ap.add_argument("--fd", type=int, default=None, help="a socket already bound to --listen (from flover serve)")
    ap.add_argument("--model", required=True, help="the checkpoint (for its tokenizer)")
    ap.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    ap.add_argument("--parent", type=int, default=None, help="stop when this process (the daemon) is gone")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_MESSAGE_BYTES, help="larger request bodies get a 413")
    defaults = HttpLimits()
    ap.add_argument("--header-timeout", type=float, default=defaults.header_timeout)
    ap.add_argument("--body-timeout", type=float, default=defaults.body_timeout)
    ap.add_argument("--keep-alive", type=float, default=defaults.keep_alive_timeout)
    ap.add_argument("--max-connections", type=int, default=defaults.max_connections)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="flover http: %(message)s", stream=sys.stderr)
    host, port = parse_listen(args.listen)
    tokenizer = load_tokenizer(open_checkpoint(args.model))
    keys = [os.environ.get(name, "").encode() for name in CURVE_ENV]
    front = Front(args.engine, args.served_model_name or args.model, tokenizer, os.environ.get("FLOVER_API_KEY"),
                  args.parent, curve=tuple(keys) if all(keys) else None, max_body_bytes=args.max_body_bytes)
    started = time.perf_counter()
    where = dict(fd=args.fd) if args.fd is not None else dict(host=host, port=port)
    limits = HttpLimits(args.header_timeout, args.body_timeout, args.keep_alive,
                        usable_connections(args.max_connections))
    config = uvicorn.Config(build_app(front), log_level="warning", access_log=False, timeout_graceful_shutdown=2,
                            http=guarded_protocol(limits), timeout_keep_alive=limits.keep_alive_timeout, **where)
    server = _server(config, front)
    log.info("listening on http://%s:%d (model %r, %s, started in %.1f s; at most %d connections, headers "
             "within %g s, bodies within %g s)", host, port, front.model_name,
             "API key required" if front.api_key else "no API key", time.perf_counter() - started,
             limits.max_connections, limits.header_timeout, limits.body_timeout)
    server.run()
    return 0 if server.started else 2


if __name__ == "__main__":
    sys.exit(main())
