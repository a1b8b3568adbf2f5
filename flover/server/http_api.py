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
import dataclasses
import logging
import os
import signal
import sys
import time

from fastapi import FastAPI

from flover.client import AsyncClient
from flover.flags import add_flags, from_flags
from flover.protocol import MAX_MESSAGE_BYTES
from flover.server.http_front import CURVE_ENV, HttpLimits, parse_listen
from flover.server.http_guard import guarded_protocol, usable_connections
from flover.server.http_routes import ROUTES
from flover.server.http_state import Front, RequireKey, as_api_error, error_response

log = logging.getLogger("flover.http")


def build_app(front: Front) -> FastAPI:
    """The app: the routes (http_routes.py), errors in OpenAI's shape, the API key if one is set."""
    app = FastAPI(title="flover", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front
    app.add_exception_handler(Exception, internal_error)
    if front.api_key:
        app.add_middleware(RequireKey, key=front.api_key)
    for method, path, handler in ROUTES:
        app.add_api_route(path, handler, methods=[method])
    return app


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    """The client to the daemon, for the app's life; and a watch on the daemon that started it."""
    front: Front = app.state.front
    curve = front.curve
    front.client = AsyncClient(
        front.engine_addr,
        curve_server_key=curve[0] if curve else None,
        curve_client_cert=curve[1:] if curve else None,
        silence_timeout=front.engine_timeout,
    )
    watch = asyncio.ensure_future(_stop_when_orphaned(front.parent_pid)) if front.parent_pid else None
    try:
        yield
    finally:
        if watch is not None:
            watch.cancel()
        await front.client.close()


async def internal_error(request, e: Exception):
    """A bug: OpenAI's error shape, never a hang."""
    return error_response(as_api_error(e))


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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="flover's OpenAI-compatible HTTP front")
    ap.add_argument("--engine", required=True, help="the daemon's ZeroMQ address")
    ap.add_argument("--listen", default="127.0.0.1:8000")
    ap.add_argument("--fd", type=int, default=None, help="a socket already bound to --listen (from flover serve)")
    ap.add_argument("--model", required=True, help="the checkpoint (for its tokenizer)")
    ap.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    ap.add_argument("--parent", type=int, default=None, help="stop when this process (the daemon) is gone")
    ap.add_argument("--max-body-bytes", type=int, default=MAX_MESSAGE_BYTES, help="larger request bodies get a 413")
    add_flags(ap, HttpLimits)
    ap.add_argument("--reasoning-format", choices=("auto", "none"), default="auto")
    return ap


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from flover.models import open_checkpoint
    from flover.models.tokenizer import load_tokenizer

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="flover http: %(message)s", stream=sys.stderr)
    host, port = parse_listen(args.listen)
    checkpoint = open_checkpoint(args.model)
    tokenizer = load_tokenizer(checkpoint)
    keys = [os.environ.get(name, "").encode() for name in CURVE_ENV]
    front = Front(
        args.engine,
        args.served_model_name or args.model,
        tokenizer,
        checkpoint.model_config(),
        os.environ.get("FLOVER_API_KEY"),
        args.parent,
        curve=tuple(keys) if all(keys) else None,
        max_body_bytes=args.max_body_bytes,
        reasoning_format=args.reasoning_format,
        engine_timeout=args.http_engine_timeout,
    )
    started = time.perf_counter()
    where = dict(fd=args.fd) if args.fd is not None else dict(host=host, port=port)
    limits = from_flags(HttpLimits, args)
    limits = dataclasses.replace(limits, max_connections=usable_connections(limits.max_connections))
    config = uvicorn.Config(
        build_app(front),
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_timeout,
        **where,
    )
    server = _server(config, front)
    log.info(
        "listening on http://%s:%d (model %r, %s, started in %.1f s; at most %d connections, headers "
        "within %g s, bodies within %g s)",
        host,
        port,
        front.model_name,
        "API key required" if front.api_key else "no API key",
        time.perf_counter() - started,
        limits.max_connections,
        limits.header_timeout,
        limits.body_timeout,
    )
    server.run()
    return 0 if server.started else 2


if __name__ == "__main__":
    sys.exit(main())
