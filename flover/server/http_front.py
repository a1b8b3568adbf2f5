"""Starting and stopping the HTTP front's process beside the daemon (`flover serve --http`).

The daemon's process binds the HTTP socket itself and hands it to the front (uvicorn's `fd`):
a port in use is one clear error before anything starts, and nothing else can answer in the
front's place while it starts.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from flover.flags import flag, to_argv
from flover.protocol import MAX_MESSAGE_BYTES


def engine_address(bind: str) -> str:
    """Where a local client reaches a daemon bound to `bind` (a wildcard bind is reached on loopback)."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if bind.startswith(wildcard):
            return "tcp://127.0.0.1:" + bind[len(wildcard) :]
    return bind


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8000")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP connection may take (enforced by http_guard.GuardedH11Protocol)."""

    header_timeout: float = field(
        default=10.0,
        metadata=flag(
            "--http-header-timeout",
            "a request's headers must arrive within this (from the connection or its previous answer)",
            metavar="SECONDS",
        ),
    )
    body_timeout: float = field(
        default=30.0,
        metadata=flag(
            "--http-body-timeout", "a request's body must arrive within this after its headers", metavar="SECONDS"
        ),
    )
    keep_alive_timeout: float = field(
        default=5.0,
        metadata=flag(
            "--http-keep-alive", "an idle connection between requests is closed after this", metavar="SECONDS"
        ),
    )
    max_connections: int = field(
        default=1024,
        metadata=flag("--http-max-connections", "open HTTP connections at once; more are closed as they arrive"),
    )
    engine_timeout: float = field(
        default=60.0,
        metadata=flag(
            "--http-engine-timeout",
            "a request whose daemon sends nothing (no token, no keepalive) for this long ends with an "
            "engine_unresponsive error (a frozen daemon or pipeline stage); /health says 503 meanwhile",
            metavar="SECONDS",
        ),
    )


CURVE_ENV = ("FLOVER_CURVE_SERVER_KEY", "FLOVER_CURVE_PUBLIC_KEY", "FLOVER_CURVE_SECRET_KEY")


def start_http_front(
    bind: str,
    listen: str,
    model: str,
    api_key: str | None,
    curve: tuple[bytes, bytes, bytes] | None = None,
    timeout: float = 120.0,
    max_body_bytes: int = MAX_MESSAGE_BYTES,
    limits: HttpLimits = HttpLimits(),
    reasoning_format: str = "auto",
) -> subprocess.Popen:
    """The front's process, once it answers HTTP; OSError naming the address if it cannot.
    `curve`: (the daemon's public key, the front's public and secret keys), z85.
    `max_body_bytes`: the largest request body it reads (the daemon's --max-message-bytes)."""
    host, port = parse_listen(listen)
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise OSError(f"cannot serve HTTP on {listen}: {e.strerror or e}") from None
    argv = ["--engine", engine_address(bind), "--fd", str(sock.fileno()), "--listen", listen, "--model", model]
    argv += ["--parent", str(os.getpid()), "--max-body-bytes", str(max_body_bytes), *to_argv(limits)]
    argv += ["--reasoning-format", reasoning_format]
    with sock:
        # its own session: a job launcher that kills the daemon's process group (mpirun, when a
        # rank dies) must not cut the front's streams off unanswered; it ends them itself once the
        # daemon is gone
        proc = subprocess.Popen(
            [sys.executable, "-m", "flover.server.http_api", *argv],
            env=_front_env(api_key, curve),
            pass_fds=[sock.fileno()],
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise OSError(f"cannot serve HTTP on {listen}: the HTTP front exited ({proc.returncode}); see above")
        try:
            conn = http.client.HTTPConnection(host, port, timeout=10)  # /health waits up to 2 s for the daemon
            conn.request("GET", "/health")
            conn.getresponse()  # any status: the front answers (the daemon itself starts serving next)
            return proc
        except OSError:
            time.sleep(0.1)
    stop_http_front(proc)
    raise OSError(f"cannot serve HTTP on {listen}: no answer after {timeout:g} s")


def _front_env(api_key: str | None, curve: tuple[bytes, bytes, bytes] | None) -> dict:
    """The front's environment: the key and the CURVE keys through it (never on its command line)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in ("FLOVER_API_KEY", *CURVE_ENV):
        env.pop(name, None)
    if api_key:
        env["FLOVER_API_KEY"] = api_key
    if curve:
        env.update({name: key.decode() for name, key in zip(CURVE_ENV, curve)})
    return env


def stop_http_front(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
