"""`flover serve`: the daemon (server/daemon.py) in front of the engine, and its OpenAI HTTP front
(server/http_front.py); `flover keygen`: CURVE key pairs for it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from flover.apps.flags import add_engine_args, start_engine
from flover.flags import add_flags, from_flags
from flover.protocol import MAX_MESSAGE_BYTES


def add_serve_command(sub) -> None:
    serve = sub.add_parser("serve", help="the daemon: a ZeroMQ socket in front of the engine")
    add_engine_args(serve, skip=())  # (--prefault-prefix-cache too)
    d = serve.add_argument_group("daemon")
    d.add_argument("--bind", default="tcp://127.0.0.1:5555", help="tcp://HOST:PORT or ipc://PATH (loopback default)")
    d.add_argument("--max-waiting", type=int, default=256, help="queued requests before `overloaded`")
    d.add_argument(
        "--max-message-bytes",
        type=int,
        default=MAX_MESSAGE_BYTES,
        help="largest message, all frames together (a larger single frame drops the connection)",
    )
    d.add_argument(
        "--max-client-backlog",
        type=int,
        default=64 << 20,
        metavar="BYTES",
        help="unread events kept for one client; beyond, its requests are cancelled (slow_client)",
    )
    d.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish work on SIGTERM")
    d.add_argument("--stats-interval", type=float, default=60.0, help="seconds between summary log lines")
    d.add_argument(
        "--keepalive-interval",
        type=float,
        default=1.0,
        help="seconds between keepalive events to clients with requests in flight "
        "(how fast a vanished client's work is cancelled)",
    )
    d.add_argument("--curve-secret-key", help="server secret certificate: enables CURVE encryption + auth")
    d.add_argument("--curve-allowed-clients", help="directory of allowed client public certificates")
    from flover.server.http_front import HttpLimits

    h = serve.add_argument_group("OpenAI-compatible HTTP API (its own process, a client of the socket)")
    h.add_argument(
        "--http",
        metavar="HOST:PORT",
        default=None,
        help="also serve the OpenAI HTTP API, e.g. 127.0.0.1:8000 (loopback unless you say otherwise)",
    )
    h.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every HTTP endpoint but /health (or set FLOVER_API_KEY)",
    )
    add_flags(h, HttpLimits)
    h.add_argument(
        "--reasoning-format",
        choices=("auto", "none"),
        default="auto",
        help="auto: a chat answer's opening <think>...</think> block (Qwen3, SmolLM3), or gpt-oss's analysis "
        "channel (harmony), comes back as reasoning_content, apart from content, where the model's chat template "
        "knows them; none: left in content (harmony's markers too)",
    )
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from flover.server.daemon import Daemon, ServeConfig

    engine = start_engine(args, serving=True)
    if engine is None:  # a follower rank: it ran the leader's iterations until shutdown
        return 0
    front_curve = None  # with CURVE, the HTTP front gets a key pair of its own, made here and allowed
    if args.http and args.curve_secret_key:
        import zmq
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(args.curve_secret_key)
        front_curve = (server_public, *zmq.curve_keypair())
    config = ServeConfig(
        bind=args.bind,
        max_waiting=args.max_waiting,
        max_message_bytes=args.max_message_bytes,
        max_client_backlog_bytes=args.max_client_backlog,
        drain_timeout=args.drain_timeout,
        stats_interval=args.stats_interval,
        keepalive_interval=args.keepalive_interval,
        curve_secret_key=args.curve_secret_key,
        curve_allowed_clients=args.curve_allowed_clients,
        curve_extra_clients=(front_curve[1],) if front_curve else (),
    )
    http = None
    try:
        daemon = Daemon(engine, config, model_name=args.model)
        if args.http:
            from flover.server.http_front import HttpLimits, start_http_front

            http = start_http_front(
                args.bind,
                args.http,
                args.model,
                args.api_key or os.environ.get("FLOVER_API_KEY"),
                curve=front_curve,
                max_body_bytes=args.max_message_bytes,
                reasoning_format=args.reasoning_format,
                limits=from_flags(HttpLimits, args),
            )
    except BaseException:
        engine.shutdown()
        raise
    try:
        return daemon.serve_forever()
    finally:
        if http is not None:
            from flover.server.http_front import stop_http_front

            stop_http_front(http)


def add_keygen_command(sub) -> None:
    keygen = sub.add_parser("keygen", help="make a CURVE key pair (zmq.auth certificate files)")
    keygen.add_argument("dir")
    keygen.add_argument("--name", default="server", help="file name stem: NAME.key and NAME.key_secret")
    keygen.set_defaults(func=cmd_keygen)


def cmd_keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    Path(args.dir).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(args.dir, args.name)
    print(f"wrote {public} (give to the other side) and {secret} (keep private)")
    return 0
