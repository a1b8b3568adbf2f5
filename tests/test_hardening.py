"""A hostile or careless client never hurts another: strict limits, failures isolated to their
request, connection-owned requests, REQ sockets, slow readers, dead servers. Real daemons and
real clients (and real `mpirun` where the class needs several ranks)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from flover import LLM, SamplingParams
from flover.client import Client, FloverError
from tests.helpers import ID_PROMPTS, MPIRUN, Server, expected_outputs
from tests.poisoned_serve import POISON_SEED

# Each of these was accepted once and then failed inside the iteration, or was silently coerced.
HOSTILE_PARAMS = [
    {"top_k": 2**63},
    {"top_k": 2**64 - 1},
    {"temperature": 2**63},
    {"temperature": 2**64 - 1},
    {"repetition_penalty": 2**63},
    {"repetition_penalty": 1e-30},
    {"max_new_tokens": 2**63},
    {"seed": 2**64 - 1},
    {"ignore_eos": "false"},
    {"ignore_eos": 0},
    {"logprobs": "no"},
    {"logprobs": [[[[1]]]]},
    {"stop": {"zz": 1}},
    {"stop": [["a"]]},
    {"stop_token_ids": "abc"},
    {"stop_token_ids": [2**63]},
    {"eos_token_ids": {"a": 1}},
    {"stop": ["x"] * 40_000},
    {"stop": ["y" * 10_000]},
    {"temperature": "0.5"},
    {"top_p": True},
    {"min_p": [0.1]},
]


@pytest.mark.parametrize(
    "params", HOSTILE_PARAMS + [{"top_k": 10**400}, {"temperature": 10**400}], ids=lambda p: next(iter(p))
)
def test_every_sampling_field_is_checked_strictly_and_against_its_limit(params):
    with pytest.raises(ValueError, match=f"SamplingParams.{next(iter(params))}"):
        SamplingParams(**params)


def test_limits_accept_their_edges_and_tiny_temperatures_are_greedy(llama_dir):
    SamplingParams(top_k=2**31 - 1, temperature=1e4, repetition_penalty=100, seed=2**63 - 1, stop=["s"] * 32)
    llm = LLM(llama_dir, dtype="float64", max_seq_len=64)
    prompt = [5, 6, 7]
    greedy = llm.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    for t in (1e-45, 1e-40, 1e-6):  # subnormal and tiny: 1/T overflowed into NaN probabilities before
        p = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=t, seed=1)
        assert p.temperature == 0.0
        assert llm.generate(prompt, p)[0].token_ids == greedy
    huge = llm.generate(
        prompt,
        SamplingParams(
            max_new_tokens=8, ignore_eos=True, top_k=2**31 - 1, temperature=2**13, repetition_penalty=100, seed=3
        ),
    )[0]
    assert len(huge.token_ids) == 8 and all(0 <= t < 512 for t in huge.token_ids)


def test_a_failure_of_one_request_inside_the_iteration_ends_that_request_alone(llama_dir, monkeypatch):
    import flover.runner.runner
    import tests.poisoned_serve as poison

    monkeypatch.setattr(flover.runner.runner, "sample", poison.poisoned_sample)
    llm = LLM(llama_dir, dtype="float64", max_seq_len=64, max_slots=4)
    params = [
        SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.9, seed=s) for s in (1, POISON_SEED, 2)
    ] + [SamplingParams(max_new_tokens=6, ignore_eos=True)]
    outs = llm.generate(ID_PROMPTS[:4], params)
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert "injected failure" in outs[1].error
    monkeypatch.setattr(flover.runner.runner, "sample", poison._real_sample)
    alone = [LLM.from_engine(llm.engine).generate(ID_PROMPTS[i], params[i])[0].token_ids for i in (0, 2, 3)]
    assert [outs[i].token_ids for i in (0, 2, 3)] == alone  # the others are untouched


def _send_hostile_while_streaming(server: Server, llama_dir: str) -> None:
    """Hostile requests (each must get its own error) while a stream runs (which must complete
    exactly); then the daemon still serves."""
    expected = expected_outputs(llama_dir, [40] * len(ID_PROMPTS))[5]
    streamed, errors = [], []

    def stream():
        try:
            with server.client() as c:
                for event in c.stream(input_ids=ID_PROMPTS[5], max_new_tokens=40, ignore_eos=True):
                    streamed.extend(event.get("token_ids", []))
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=stream)
    thread.start()
    with server.client() as c:
        for n, params in enumerate(HOSTILE_PARAMS):
            c.send({"op": "generate", "id": n, "input_ids": [1, 2, 3], "params": params})
        for n in range(len(HOSTILE_PARAMS)):
            with pytest.raises(FloverError, match="invalid_request") as refused:
                c.wait(n)
            assert refused.value.request_id == n
        thread.join(timeout=120)
        assert not errors, errors
        assert streamed == expected.token_ids
        assert c.generate(input_ids=ID_PROMPTS[2], max_new_tokens=3, ignore_eos=True)["usage"]["completion_tokens"] == 3


def test_hostile_values_are_refused_and_never_reach_the_iteration(llama_dir):
    server = Server(llama_dir, "--max-slots", "4")
    try:
        _send_hostile_while_streaming(server, llama_dir)
    finally:
        assert server.stop()[0] == 0


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun")
def test_tp2_job_survives_hostile_values_and_a_failing_request(llama_dir):
    """Under mpirun a failure inside the iteration used to end the whole job. Rank 0 refuses the
    values at intake; a request-specific failure that still happens (the poisoned sampler) ends
    that request alone, on every rank."""
    server = Server(llama_dir, "--max-slots", "4", ranks=2, script="tests/poisoned_serve.py")
    try:
        _send_hostile_while_streaming(server, llama_dir)
        expected = expected_outputs(llama_dir, [8] * len(ID_PROMPTS))
        with server.client() as c:
            c.send(
                {
                    "op": "generate",
                    "id": "poison",
                    "input_ids": ID_PROMPTS[1],
                    "params": {"max_new_tokens": 8, "temperature": 0.5, "seed": POISON_SEED},
                }
            )
            for i in range(4):
                c.send(
                    {
                        "op": "generate",
                        "id": i,
                        "input_ids": ID_PROMPTS[i],
                        "params": {"max_new_tokens": 8, "ignore_eos": True},
                    }
                )
            with pytest.raises(FloverError, match="internal_error.*injected failure"):
                c.wait("poison")
            assert [c.wait(i)["token_ids"] for i in range(4)] == [e.token_ids for e in expected[:4]]
            assert c.stats()["slots_used"] == 0
    finally:
        code, err = server.stop(signal.SIGUSR1)
    assert code == 0, err[-2000:]


def test_the_poisoned_request_fails_alone_in_a_single_process_daemon(llama_dir):
    server = Server(llama_dir, "--max-slots", "4", script="tests/poisoned_serve.py")
    try:
        with server.client() as c:
            c.send(
                {
                    "op": "generate",
                    "id": "poison",
                    "input_ids": ID_PROMPTS[1],
                    "params": {"max_new_tokens": 8, "temperature": 0.5, "seed": POISON_SEED},
                }
            )
            c.send(
                {
                    "op": "generate",
                    "id": "ok",
                    "input_ids": ID_PROMPTS[2],
                    "params": {"max_new_tokens": 8, "ignore_eos": True},
                }
            )
            with pytest.raises(FloverError, match="internal_error"):
                c.wait("poison")
            assert c.wait("ok")["token_ids"] == expected_outputs(llama_dir, [8] * len(ID_PROMPTS))[2].token_ids
    finally:
        assert server.stop()[0] == 0


def test_expensive_requests_are_bounded_before_they_cost_the_loop(llama_dir):
    server = Server(llama_dir, "--max-seq-len", "64")
    try:
        with server.client() as c:
            with pytest.raises(FloverError, match="prompt_too_long.*refused before tokenizing"):
                c.generate("word " * 200_000)  # 1 MB: refused by its size, never tokenized
            with pytest.raises(FloverError, match="prompt_too_long"):
                c.generate(input_ids=[1] * 100_000)  # too many ids: refused before checking each
            with pytest.raises(FloverError, match="invalid_request.*at most 32 stop strings"):
                c.generate("hi", stop=[f"s{i}" for i in range(40_000)])
            assert c.health()["status"] == "ok"
    finally:
        assert server.stop()[0] == 0


def raw_socket(addr: str, kind=zmq.DEALER, routing_id: bytes | None = None):
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(addr)
    return ctx, sock


def recv_event(sock, timeout_ms: int = 10_000) -> dict | None:
    return msgpack.unpackb(sock.recv()) if sock.poll(timeout_ms) else None


def test_multipart_messages_are_capped_as_a_whole_and_answered(llama_dir):
    server = Server(llama_dir, "--max-message-bytes", "10000")
    ctx, sock = raw_socket(server.addr)
    try:
        big = msgpack.packb({"op": "health", "id": "h"})
        sock.send_multipart([b"x" * 1000] * 30 + [big])  # every frame is under the cap, the whole is not
        event = recv_event(sock)
        assert event["event"] == "error" and event["code"] == "message_too_large"
        sock.send_multipart([b"a", b"b", b"c", big])
        assert recv_event(sock)["code"] == "bad_message"
        sock.send(big)
        assert recv_event(sock)["status"] == "ok"  # the same connection goes on
    finally:
        sock.close()
        ctx.term()
        assert server.stop()[0] == 0


def test_ids_come_back_as_sent_and_are_free_again_once_finished(server):
    with server.client() as c:
        for _ in range(3):  # the same id, again and again, once each has finished
            assert c.generate(input_ids=[1, 2], max_new_tokens=2, request_id=7)["id"] == 7
        assert c.generate(input_ids=[1, 2], max_new_tokens=2, request_id="7")["id"] == "7"
        for bad in ("", "x" * 300):  # invalid ids: the error still carries them, so it can be matched
            c.send({"op": "generate", "id": bad, "input_ids": [1]})
            with pytest.raises(FloverError, match="invalid_request") as refused:
                c.wait(bad)
            assert refused.value.request_id == bad


def test_req_sockets_get_exactly_one_reply_per_request(server, llama_dir):
    expected = expected_outputs(llama_dir, [5] * len(ID_PROMPTS))[3]
    ctx, sock = raw_socket(server.addr, zmq.REQ)
    try:
        sock.send(
            msgpack.packb(
                {
                    "op": "generate",
                    "id": "q",
                    "input_ids": ID_PROMPTS[3],
                    "params": {"max_new_tokens": 5, "ignore_eos": True},
                }
            )
        )
        final = recv_event(sock)
        assert final["event"] == "final" and final["token_ids"] == expected.token_ids
        sock.send(msgpack.packb({"op": "health"}))
        assert recv_event(sock)["status"] == "ok"
        sock.send(msgpack.packb({"op": "generate", "id": "s", "input_ids": [1], "stream": True}))
        refused = recv_event(sock)
        assert refused["code"] == "invalid_request" and "DEALER" in refused["message"]
    finally:
        sock.close()
        ctx.term()


def test_a_chosen_routing_id_is_refused_and_cannot_take_over_requests(llama_dir, tmp_path):
    """With CURVE: another allowed client that sets a routing id is refused; one that claims an
    identity of the server's kind (a zero byte first) is just another connection: it gets
    nothing of the first client's requests and cannot cancel them."""
    cli = [sys.executable, "-m", "flover.apps.cli"]
    for name, where in (("server", "server"), ("alice", "clients"), ("mallory", "clients")):
        subprocess.run([*cli, "keygen", str(tmp_path / where), "--name", name], check=True, capture_output=True)
    srv = Server(
        llama_dir,
        "--curve-secret-key",
        str(tmp_path / "server" / "server.key_secret"),
        "--curve-allowed-clients",
        str(tmp_path / "clients"),
        "--max-seq-len",
        "512",
    )
    from zmq.auth import load_certificate

    server_key, _ = load_certificate(str(tmp_path / "server" / "server.key"))

    def curve_socket(name: str, routing_id: bytes | None):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        public, secret = load_certificate(str(tmp_path / "clients" / f"{name}.key_secret"))
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_key
        sock.connect(srv.addr)
        return ctx, sock

    try:
        alice = Client(
            srv.addr,
            timeout=30,
            curve_server_key=server_key,
            curve_client_cert=str(tmp_path / "clients" / "alice.key_secret"),
        )
        alice.send(
            {
                "op": "generate",
                "id": "secret",
                "input_ids": [1, 2],
                "params": {"max_new_tokens": 400, "ignore_eos": True},
            }
        )
        assert alice.stats()["in_flight"] == 1
        for claimed in (b"alice", b"\x00\x00\x00\x00\x01", b"\x00" + bytes(4)):
            ctx, mallory = curve_socket("mallory", claimed)
            mallory.send(msgpack.packb({"op": "cancel", "id": "secret"}))
            reply = recv_event(mallory, 3000)
            assert reply["code"] == ("unknown_id" if claimed[0] == 0 else "routing_id_not_allowed"), reply
            assert recv_event(mallory, 300) is None  # and nothing of alice's
            mallory.close()
            ctx.term()
        final = alice.wait("secret")
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 400
        # Nor can mallory learn what alice's prompts began with from a faster first token: each
        # client key is a prefix-cache partition of its own.
        prompt = [(13 * i) % 500 + 1 for i in range(40)]
        params = {"max_new_tokens": 2}
        assert alice.generate(input_ids=prompt, **params)["usage"]["cached_tokens"] == 0
        assert alice.generate(input_ids=prompt, **params)["usage"]["cached_tokens"] == 32
        mallory_client = Client(
            srv.addr,
            timeout=30,
            curve_server_key=server_key,
            curve_client_cert=str(tmp_path / "clients" / "mallory.key_secret"),
        )
        assert mallory_client.generate(input_ids=prompt, **params)["usage"]["cached_tokens"] == 0
        assert mallory_client.generate(input_ids=prompt, **params)["usage"]["cached_tokens"] == 32
        mallory_client.close()
        alice.close()
    finally:
        assert srv.stop()[0] == 0


def test_a_new_connection_never_receives_events_of_an_earlier_one(server):
    ctx, sock = raw_socket(server.addr)
    try:
        sock.send(
            msgpack.packb(
                {
                    "op": "generate",
                    "id": "old",
                    "input_ids": [1, 2],
                    "params": {"max_new_tokens": 200, "ignore_eos": True},
                    "stream": True,
                }
            )
        )
        assert recv_event(sock)["event"] == "token"
        sock.disconnect(server.addr)  # the same socket, a new connection
        while sock.poll(0):
            sock.recv()
        sock.connect(server.addr)
        sock.send(msgpack.packb({"op": "health", "id": "new"}))
        events = []
        while (event := recv_event(sock, 1500)) is not None:
            events.append(event)
        assert [e["id"] for e in events] == ["new"]
        with Client(server.addr) as c:
            deadline = time.time() + 10
            while c.stats()["in_flight"] and time.time() < deadline:
                time.sleep(0.05)
            assert c.stats()["in_flight"] == 0  # the old connection's request was cancelled
    finally:
        sock.close()
        ctx.term()


def _stream_without_reading(server: Server, n: int, pause: float) -> dict:
    """n streams of 480 tokens from a socket that reads nothing for `pause` seconds (ipc: small
    kernel buffers, so the server's own backlog is what holds the events); then read it all."""
    ctx, sock = raw_socket(server.addr)
    sock.setsockopt(zmq.RCVHWM, 1)
    try:
        for i in range(n):
            sock.send(
                msgpack.packb(
                    {
                        "op": "generate",
                        "id": i,
                        "input_ids": [i + 1],
                        "stream": True,
                        "params": {"max_new_tokens": 480, "ignore_eos": True},
                    }
                )
            )
        time.sleep(pause)
        tokens, ends = {i: [] for i in range(n)}, {}
        while len(ends) < n:
            event = recv_event(sock, 60_000)
            assert event is not None, f"{len(ends)} of {n} requests ended; the rest hang"
            if event["event"] == "token":
                tokens[event["id"]] += event["token_ids"]
            else:
                assert event.get("id") in tokens and event["id"] not in ends, event  # one end per request
                ends[event["id"]] = event
        return {i: (tokens[i], ends[i]) for i in range(n)}
    finally:
        sock.close()
        ctx.term()


def test_a_client_that_reads_late_gets_every_event(llama_dir, tmp_path):
    server = Server(llama_dir, "--max-seq-len", "512", "--max-slots", "40", addr=f"ipc://{tmp_path}/s")
    try:
        results = _stream_without_reading(server, 40, 6)
        assert all(end["event"] == "final" and len(tokens) == 480 for tokens, end in results.values())
    finally:
        assert server.stop()[0] == 0


def test_a_client_that_never_reads_is_cancelled_and_told_so(llama_dir, tmp_path):
    server = Server(
        llama_dir,
        "--max-seq-len",
        "512",
        "--max-slots",
        "40",
        "--max-client-backlog",
        "100000",
        addr=f"ipc://{tmp_path}/s",
    )
    try:
        results = _stream_without_reading(server, 40, 6)
        assert {end["event"] for _, end in results.values()} == {"error"}
        assert {end["code"] for _, end in results.values()} == {"slow_client"}
        assert all(f"after {len(tokens)} tokens" in end["message"] for tokens, end in results.values())
        with server.client() as c:
            stats = c.stats()
        assert stats["slow_clients"] == 1 and stats["completed"] == 0 and stats["in_flight"] == 0
    finally:
        assert server.stop()[0] == 0


def test_the_client_notices_a_dead_server_within_seconds(llama_dir):
    server = Server(llama_dir, "--max-seq-len", "512")
    with Client(server.addr) as c:  # no timeout: the lost connection alone must end the wait
        c.send({"op": "generate", "id": "a", "input_ids": [1], "params": {"max_new_tokens": 480, "ignore_eos": True}})
        assert c.stats()["in_flight"] == 1
        server.proc.kill()
        start = time.time()
        with pytest.raises(FloverError, match="connection_lost"):
            c.wait("a")
        assert time.time() - start < 10
        # Sent while the connection is down (what `flover run --connect` did after a cancelled
        # final during shutdown, and then waited forever): its connection_lost comes at once.
        start = time.time()
        with pytest.raises(FloverError, match="connection_lost"):
            c.generate(input_ids=[1], max_new_tokens=2)
        assert time.time() - start < 1
        # A server back on the same address: the client reconnects and is served again.
        server = Server(llama_dir, "--max-seq-len", "512", addr=server.addr)
        try:
            deadline = time.time() + 30
            while True:
                try:
                    assert c.generate(input_ids=[1], max_new_tokens=2, ignore_eos=True)["finish_reason"] == "length"
                    break
                except FloverError as e:  # until the reconnection's handshake has been seen
                    assert e.code == "connection_lost" and time.time() < deadline
                    time.sleep(0.1)
        finally:
            assert server.stop()[0] == 0


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun")
def test_a_dead_rank_ends_the_job_and_the_client_is_told(llama_dir):
    import psutil

    server = Server(llama_dir, "--max-seq-len", "512", ranks=2)
    with Client(server.addr) as c:
        c.send({"op": "generate", "id": "a", "input_ids": [1], "params": {"max_new_tokens": 480, "ignore_eos": True}})
        assert c.stats()["in_flight"] == 1
        ranks = [
            p
            for p in psutil.Process(server.proc.pid).children(recursive=True)
            if p.environ().get("OMPI_COMM_WORLD_RANK") == "1"
        ]
        assert len(ranks) == 1
        ranks[0].kill()
        with pytest.raises(FloverError, match="connection_lost"):
            c.wait("a")
    assert server.proc.wait(timeout=60) != 0


def test_port_in_use_is_one_line(llama_dir):
    server = Server(llama_dir)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "flover.apps.cli", "serve", "--model", llama_dir, "--bind", server.addr],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        error = [line for line in run.stderr.splitlines() if "error" in line]
        assert error == [f"flover: error: cannot listen on {server.addr}: Address already in use"]
    finally:
        assert server.stop()[0] == 0


def test_a_second_sigint_stops_at_once_with_cancelled_finals(llama_dir):
    server = Server(llama_dir, "--max-seq-len", "512", "--drain-timeout", "120")
    with server.client() as c:
        for rid in ("a", "b"):
            c.send(
                {"op": "generate", "id": rid, "input_ids": [1], "params": {"max_new_tokens": 480, "ignore_eos": True}}
            )
        assert c.stats()["in_flight"] == 2
        server.proc.send_signal(signal.SIGINT)
        deadline = time.time() + 10
        while c.health()["status"] != "draining" and time.time() < deadline:
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGINT)
        finals = [c.wait(rid) for rid in ("a", "b")]
    assert all(f["finish_reason"] in ("cancelled", "length") for f in finals)
    assert any(f["finish_reason"] == "cancelled" for f in finals)
    assert server.proc.wait(timeout=30) == 0


def test_the_async_client_notices_a_dead_server_too(llama_dir):
    import asyncio

    from flover.client import AsyncClient

    server = Server(llama_dir, "--max-seq-len", "512")

    async def main():
        async with AsyncClient(server.addr) as c:
            task = asyncio.ensure_future(c.generate(input_ids=[1], max_new_tokens=480, ignore_eos=True))
            while (await c.stats())["in_flight"] != 1:
                await asyncio.sleep(0.01)
            server.proc.kill()
            with pytest.raises(FloverError, match="connection_lost"):
                await task
            with pytest.raises(FloverError, match="connection_lost"):  # sent after the loss: told at once
                await asyncio.wait_for(c.generate(input_ids=[1], max_new_tokens=2), 2)

    asyncio.run(asyncio.wait_for(main(), 30))
    server.proc.wait()
