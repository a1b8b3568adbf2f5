"""The HTTP front under hostile or careless clients (a real `flover serve --http`, real sockets):
input no layer past the front can take is a 400 before anything is encoded or queued, a request
never hangs, half-sent requests and idle connections are closed, connections are capped, and a
client that hangs up leaves the queue whether it streams or not."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.helpers import Server, free_port

BIG = 2**64 + 5


@pytest.fixture(scope="module")
def front(make_model):
    port = free_port()
    server = Server(
        make_model("llama"),
        "--max-slots",
        "2",
        "--max-waiting",
        "6",
        "--max-seq-len",
        "512",
        "--http",
        f"127.0.0.1:{port}",
        "--http-header-timeout",
        "1.5",
        "--http-body-timeout",
        "1.5",
        "--http-max-connections",
        "24",
    )
    yield server, f"http://127.0.0.1:{port}", port
    server.stop(signal.SIGKILL)


def post(url: str, path: str, body, timeout: float = 20.0) -> httpx.Response:
    """The body as JSON text with every non-ASCII character escaped, so lone surrogates go as sent."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=timeout)


def in_flight(server) -> dict:
    with server.client() as c:
        return c.stats()


def assert_still_serving(url: str) -> None:
    ok = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


HOSTILE = [
    ("/v1/completions", {"prompt": "a \ud800 b", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": ["\udfff"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2}, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
        "messages",
    ),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "top_p": 10**400}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 10**30}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": BIG}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stop_token_ids": [BIG]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2, BIG], "max_tokens": 0, "echo": True, "logprobs": 1}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999], "max_tokens": 0, "echo": True, "logprobs": 1}, None),
    ("/v1/completions", {"prompt": [1, -5], "max_tokens": 0, "echo": True, "logprobs": 1}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": -BIG}, "seed"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_input_nothing_past_the_front_can_take_is_a_400_never_a_500_or_a_hang(front, stream):
    server, url, _ = front
    for path, body, param in HOSTILE:
        if stream and path != "/tokenize":
            body = {**body, "stream": True}
        answer = post(url, path, body)  # a hang is a ReadTimeout here
        assert answer.status_code == 400, (path, body, answer.status_code, answer.text[:300])
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
        if param is not None:
            assert error["param"] == param, (body, error)
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    answer = post(url, "/v1/completions", deep)
    assert answer.status_code == 400 and "nest" in answer.json()["error"]["message"]
    nested = "deep"
    for _ in range(70):
        nested = [nested]
    wide = {"prompt": "x", "max_tokens": 2, "metadata": {"a": nested}}
    answer = post(url, "/v1/completions", wide)
    assert answer.status_code == 400 and "metadata" in answer.json()["error"]["message"]
    time.sleep(0.3)
    assert in_flight(server)["in_flight"] == 0  # nothing was queued, nothing hangs
    assert_still_serving(url)


def test_tokenize_is_bounded_like_completions_and_never_stalls_the_front(front):
    _, url, _ = front
    started = time.monotonic()
    refused = post(url, "/tokenize", {"prompt": "1" * 1_000_000})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "prompt_too_long"
    assert time.monotonic() - started < 10
    chat = post(url, "/tokenize", {"messages": [{"role": "user", "content": "1" * 900_000}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "prompt_too_long"
    # Texts that fit are tokenized off the event loop: /health answers while several run.
    fits = {"prompt": "12 34 " * 300}
    results, threads = (
        [],
        [threading.Thread(target=lambda: results.append(post(url, "/tokenize", fits))) for _ in range(6)],
    )
    for t in threads:
        t.start()
    health = httpx.get(f"{url}/health", timeout=10)
    for t in threads:
        t.join()
    assert health.status_code == 200
    assert [r.status_code for r in results] == [200] * 6


def _recv_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """What the server sent before it closed the connection, and after how long (or `limit`)."""
    sock.settimeout(0.2)
    started, got = time.monotonic(), b""
    while time.monotonic() - started < limit:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
    return got, time.monotonic() - started


def test_half_sent_requests_are_closed_and_connections_are_capped(front):
    _, url, port = front
    half_headers = socket.create_connection(("127.0.0.1", port))
    half_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    half_body = socket.create_connection(("127.0.0.1", port))
    half_body.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 200\r\n\r\n{"prompt": '
    )
    silent = socket.create_connection(("127.0.0.1", port))
    for sock in (half_headers, half_body, silent):
        _, waited = _recv_until_closed(sock, 8.0)
        assert waited < 6.0, "a half-sent request kept its connection"
        sock.close()
    # A keep-alive connection that starts a second request and stops is closed too.
    keep = socket.create_connection(("127.0.0.1", port))
    keep.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.5)
    keep.sendall(b"GET /hea")
    got, waited = _recv_until_closed(keep, 8.0)
    assert got.startswith(b"HTTP/1.1 ") and waited < 6.0
    keep.close()

    hogs = []
    for _ in range(40):  # the cap is 24: the rest are closed as they arrive
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /he")
        hogs.append(s)
    time.sleep(0.3)
    closed_at_once = 0
    for s in hogs:
        s.settimeout(0.05)
        try:
            closed_at_once += s.recv(1) == b""
        except socket.timeout:
            pass
        except ConnectionResetError:
            closed_at_once += 1
    assert closed_at_once >= 40 - 24
    time.sleep(2.5)  # the header deadline frees the rest
    for s in hogs:
        s.close()
    assert_still_serving(url)


@pytest.fixture(scope="module")
def slow_front(tmp_path_factory):
    """A model slow enough (~5 ms a step) that 2 requests of 500 tokens hold both slots for seconds."""
    from flover.testing.tiny_model import make_tiny_model
    from tests.helpers import TEST_PRESET

    out = tmp_path_factory.mktemp("slow")
    make_tiny_model("llama", {**TEST_PRESET, "hidden_size": 512, "num_layers": 6, "intermediate_size": 2048}, out)
    port = free_port()
    server = Server(
        str(out), "--max-slots", "2", "--max-waiting", "6", "--max-seq-len", "512", "--http", f"127.0.0.1:{port}"
    )
    yield server, f"http://127.0.0.1:{port}"
    server.stop(signal.SIGKILL)


def test_a_streamed_client_that_hangs_up_while_queued_leaves_the_queue(slow_front):
    server, url = slow_front
    busy = {"prompt": "x", "max_tokens": 500, "ignore_eos": True, "n": 2, "stream": True}
    done = threading.Event()

    def hold_both_slots():  # until the checks are done; then it hangs up (which frees them at once)
        with httpx.stream("POST", f"{url}/v1/completions", json=busy, timeout=120) as r:
            for _ in r.iter_lines():
                if done.is_set():
                    break

    blocker = threading.Thread(target=hold_both_slots)
    blocker.start()
    deadline = time.monotonic() + 10
    while in_flight(server)["running"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert in_flight(server)["running"] == 2, "the two slots should be busy"
    for _ in range(4):
        with pytest.raises(httpx.ReadTimeout):  # waits in the queue; the client gives up after 0.3 s
            with httpx.stream(
                "POST", f"{url}/v1/completions", timeout=0.3, json={"prompt": "y", "max_tokens": 5, "stream": True}
            ) as r:
                r.read()
    time.sleep(0.4)  # within a poll (50 ms) and an iteration
    now = in_flight(server)
    assert now["running"] == 2 and now["waiting"] == 0, ("streams that hung up still hold places in the queue", now)
    many = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 8})  # 6 places wait at most
    assert many.status_code == 429
    assert many.json()["error"]["type"] == "rate_limit_error" and many.json()["error"]["code"] == "overloaded"
    done.set()
    blocker.join(120)
    assert_still_serving(url)


def test_a_frozen_daemon_gives_the_fronts_clients_an_error_within_the_engine_timeout(make_model):
    """SIGSTOP of the daemon (its host gone silent, its connections open): a running stream gets an
    `engine_unresponsive` error event and [DONE], a new request a 503, within --http-engine-timeout;
    /health says 503 as well; after SIGCONT everything is served again."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server(
        make_model("llama"), "--max-seq-len", "512", "--http", f"127.0.0.1:{port}", "--http-engine-timeout", "2"
    )
    try:
        body = {"prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            server.proc.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        waited = time.monotonic() - frozen
        errors = [json.loads(line[6:])["error"] for line in rest if '"error"' in line]
        assert rest[-1] == "data: [DONE]" and errors and errors[-1]["code"] == "engine_unresponsive", rest[-3:]
        assert waited < 20
        started = time.monotonic()
        late = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=60)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_unresponsive", late.text
        assert time.monotonic() - started < 20
        assert httpx.get(f"{url}/health", timeout=30).status_code == 503
        server.proc.send_signal(signal.SIGCONT)
        assert_still_serving(url)
    finally:
        server.proc.send_signal(signal.SIGCONT)
        server.stop(signal.SIGKILL)
