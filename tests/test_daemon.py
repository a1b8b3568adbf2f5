"""`flover serve` as real processes on loopback, with real clients."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from flover.client import AsyncClient, Client, FloverError
from tests.helpers import ID_PROMPTS, Server, expected_outputs, free_port, send_id_prompts


def test_concurrent_clients_streaming_and_not_equal_the_offline_api(server, llama_dir):
    n_tokens = [4 + 3 * (i % 5) for i in range(len(ID_PROMPTS))]
    expected = expected_outputs(llama_dir, n_tokens)
    results, errors = {}, []

    def worker(indices, stream):
        try:
            with server.client() as c:
                for i in indices:
                    if stream:
                        events = list(c.stream(input_ids=ID_PROMPTS[i], max_new_tokens=n_tokens[i], ignore_eos=True))
                        tokens = [t for e in events if e["event"] == "token" for t in e["token_ids"]]
                        text = "".join(e["text"] or "" for e in events if e["event"] == "token")
                        assert [e["event"] for e in events].count("final") == 1 and events[-1]["event"] == "final"
                        results[i] = (tokens, text, events[-1]["finish_reason"])
                    else:
                        final = c.generate(input_ids=ID_PROMPTS[i], max_new_tokens=n_tokens[i], ignore_eos=True)
                        results[i] = (final["token_ids"], final["text"], final["finish_reason"])
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(range(k, len(ID_PROMPTS), 4), k % 2 == 0)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i, exp in enumerate(expected):
        assert results[i] == (exp.token_ids, exp.text, "length"), i


def test_async_client_runs_requests_concurrently(server, llama_dir):
    n_tokens = [6] * len(ID_PROMPTS)
    expected = expected_outputs(llama_dir, n_tokens)

    async def main():
        async with AsyncClient(server.addr) as c:
            finals = await asyncio.gather(
                *(c.generate(input_ids=p, max_new_tokens=6, ignore_eos=True) for p in ID_PROMPTS)
            )
            streamed = [e async for e in c.stream(input_ids=ID_PROMPTS[3], max_new_tokens=6, ignore_eos=True)]
            return finals, streamed, await c.health()

    finals, streamed, health = asyncio.run(asyncio.wait_for(main(), 60))
    assert [f["token_ids"] for f in finals] == [e.token_ids for e in expected]
    assert [t for e in streamed if e["event"] == "token" for t in e["token_ids"]] == expected[3].token_ids
    assert health["status"] == "ok"


def test_cancel_mid_stream_frees_the_slot(llama_dir):
    srv = Server(llama_dir, "--max-seq-len", "512")
    try:
        with srv.client() as c:
            rid = "long-one"
            events = c.stream(input_ids=[1, 2, 3], request_id=rid, max_new_tokens=500, ignore_eos=True)
            got = [next(events) for _ in range(3)]
            assert all(e["event"] == "token" for e in got)
            c.cancel(rid)
            final = list(events)[-1]
            assert final["event"] == "final" and final["finish_reason"] == "cancelled"
            assert final["usage"]["completion_tokens"] < 100  # stopped soon after, not after 500 tokens
            assert c.stats()["slots_used"] == 0
            with pytest.raises(FloverError, match="unknown_id"):
                c.cancel("never-sent")
                c.wait("never-sent")
    finally:
        srv.stop()


def test_a_killed_client_has_its_requests_cancelled(llama_dir):
    server = Server(llama_dir, "--keepalive-interval", "0.1", "--max-seq-len", "512")
    script = (
        f"from flover.client import Client\n"
        f"c = Client({server.addr!r})\n"
        f"for e in c.stream(input_ids=[1, 2, 3], max_new_tokens=500, ignore_eos=True): print('tok', flush=True)\n"
    )
    script_slow = (
        f"import time\nfrom flover.client import Client\n"
        f"c = Client({server.addr!r})\n"
        f"c.send({{'op': 'generate', 'id': 'x', 'input_ids': [4, 5], 'params': {{'max_new_tokens': 500, "
        f"'ignore_eos': True}}}})\nprint('sent', flush=True)\ntime.sleep(60)\n"
    )
    try:
        for code in (script, script_slow):  # a streaming client, and one waiting for a non-streamed reply
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            proc.stdout.readline()
            with server.client() as c:
                deadline = time.time() + 10
                while c.stats()["slots_used"] != 1 and time.time() < deadline:
                    time.sleep(0.01)  # the other client's request may not be read yet
                assert c.stats()["slots_used"] == 1
                proc.kill()
                proc.wait()
                deadline = time.time() + 10
                while c.stats()["slots_used"] and time.time() < deadline:
                    time.sleep(0.1)
                stats = c.stats()
                assert stats["slots_used"] == 0 and stats["in_flight"] == 0, stats
        assert stats["clients_gone"] == 2 and stats["completed"] == 0  # cancelled, not run to the end
    finally:
        assert server.stop()[0] == 0


def hostile_frames(rng: random.Random) -> list[list[bytes]]:
    """Frames a broken or malicious client might send (each a list of frames after the identity)."""
    nan, inf = float("nan"), float("inf")
    bad_params = [
        {"temperature": nan},
        {"temperature": -1},
        {"top_p": inf},
        {"top_p": 0},
        {"top_k": -5},
        {"max_new_tokens": 0},
        {"max_new_tokens": 10**9},
        {"max_new_tokens": "many"},
        {"seed": -1},
        {"seed": 2**64 - 1},
        {"stop": 5},
        {"stop": [""]},
        {"stop_token_ids": ["a"]},
        {"repetition_penalty": 0},
        {"min_p": 2},
        {"nonsense": 1},
        {"logprobs": "yes"},
    ]
    frames = []
    for _ in range(3000):
        kind = rng.randrange(9)
        if kind == 0:
            frames.append([rng.randbytes(rng.randint(0, 64))])
        elif kind == 1:
            frames.append([msgpack.packb(rng.choice([1, "x", [1, 2], None, 3.5, True]))])
        elif kind == 2:
            frames.append([msgpack.packb({"op": rng.choice(["gen", None, 5, "generate "])})])
        elif kind == 3:
            frames.append(
                [
                    msgpack.packb(
                        {"op": "generate", "id": rng.randrange(10**6), "prompt": "x", "params": rng.choice(bad_params)}
                    )
                ]
            )
        elif kind == 4:
            frames.append(
                [
                    msgpack.packb(
                        {
                            "op": "generate",
                            "id": f"v{rng.randrange(10**6)}",
                            "input_ids": rng.choice([[-1], [10**9], ["a"], [], [1.5], list(range(300))]),
                        }
                    )
                ]
            )
        elif kind == 5:
            frames.append(
                [msgpack.packb({"op": "generate", "id": rng.choice([None, "", "x" * 1000, [1], True]), "prompt": "x"})]
            )
        elif kind == 6:
            frames.append(
                [msgpack.packb({"op": "generate", "id": "m", "messages": rng.choice(["hi", [1], [{"role": 1}]])})]
            )
        elif kind == 7:
            frames.append([b"", b"", msgpack.packb({"op": "health"})])  # wrong framing
        else:
            frames.append([msgpack.packb({"op": "cancel", "id": rng.choice(["nope", None, 3])})])
    return frames


def test_fuzz_malformed_frames_while_valid_requests_run(server, llama_dir):
    n_tokens = [10] * len(ID_PROMPTS)
    expected = expected_outputs(llama_dir, n_tokens)
    results, errors = {}, []

    def valid_traffic():
        try:
            with server.client() as c:
                for i, p in enumerate(ID_PROMPTS):
                    results[i] = c.generate(input_ids=p, max_new_tokens=10, ignore_eos=True)["token_ids"]
        except Exception as e:
            errors.append(e)

    good = threading.Thread(target=valid_traffic)
    good.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.addr)
    frames = hostile_frames(random.Random(0))
    for f in frames:
        sock.send_multipart(f)
    replies = []
    deadline = time.time() + 60
    while len(replies) < len(frames) and time.time() < deadline:
        if sock.poll(1000):
            replies.append(msgpack.unpackb(sock.recv()))
    good.join(timeout=120)
    sock.close()
    ctx.term()
    assert not errors, errors
    assert [results[i] for i in range(len(ID_PROMPTS))] == [e.token_ids for e in expected]
    events = [r.get("event") for r in replies]
    assert events.count("error") >= 0.95 * len(frames), {e: events.count(e) for e in set(events)}
    codes = {r.get("code") for r in replies if r.get("event") == "error"}
    assert {"bad_message", "invalid_request", "unknown_op", "prompt_too_long", "unknown_id"} <= codes, codes
    assert all(isinstance(r.get("message"), str) for r in replies if r.get("event") == "error")
    with server.client() as c:
        assert c.health()["status"] == "ok"
        assert (
            c.generate(input_ids=ID_PROMPTS[0], max_new_tokens=10, ignore_eos=True)["token_ids"]
            == expected[0].token_ids
        )


def test_oversize_messages_are_dropped_and_the_daemon_lives(llama_dir):
    srv = Server(llama_dir, "--max-message-bytes", "2000")
    try:
        ctx = zmq.Context()
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(srv.addr)
        big.send(msgpack.packb({"op": "generate", "id": "big", "prompt": "x" * 10000}))
        assert not big.poll(1000)  # no reply: ZeroMQ dropped the connection
        big.close()
        ctx.term()
        with srv.client() as c:
            assert c.health()["status"] == "ok"
    finally:
        code, _ = srv.stop()
    assert code == 0


def test_overloaded_when_the_waiting_queue_is_full(llama_dir):
    srv = Server(llama_dir, "--max-slots", "1", "--max-waiting", "2")
    try:
        with srv.client() as c:
            ids = [f"r{i}" for i in range(8)]
            for rid in ids:
                c.send(
                    {
                        "op": "generate",
                        "id": rid,
                        "input_ids": [1, 2],
                        "params": {"max_new_tokens": 50, "ignore_eos": True},
                    }
                )
            outcomes = {}
            for rid in ids:
                try:
                    outcomes[rid] = c.wait(rid)["finish_reason"]
                except FloverError as e:
                    outcomes[rid] = e.code
        assert list(outcomes.values()).count("length") >= 2  # at least the two the queue holds
        assert "overloaded" in outcomes.values()
        assert set(outcomes.values()) <= {"length", "overloaded"}
        with pytest.raises(FloverError, match="duplicate_id"):
            with srv.client() as c:
                c.send({"op": "generate", "id": "d", "input_ids": [1], "params": {"max_new_tokens": 100}})
                c.send({"op": "generate", "id": "d", "input_ids": [1], "params": {"max_new_tokens": 100}})
                c.wait("d")
                c.wait("d")
    finally:
        srv.stop()


def test_sigterm_drains_in_flight_requests_then_exits_0(llama_dir):
    srv = Server(llama_dir, "--drain-timeout", "30", "--max-seq-len", "512")
    try:
        with srv.client() as c:
            c.send(
                {
                    "op": "generate",
                    "id": "a",
                    "input_ids": [1, 2],
                    "params": {"max_new_tokens": 500, "ignore_eos": True},
                }
            )
            assert c.stats()["in_flight"] == 1
            srv.proc.send_signal(signal.SIGTERM)
            deadline = time.time() + 10
            while not c.health()["status"] == "draining" and time.time() < deadline:
                time.sleep(0.01)
            with pytest.raises(FloverError, match="shutting_down"):
                c.generate(input_ids=[3], max_new_tokens=2)
            final = c.wait("a")  # the request in flight still completes
            assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 500
    finally:
        code, err = srv.stop()
    assert code == 0 and "draining" in err


def test_drain_timeout_cancels_what_is_left(llama_dir):
    srv = Server(llama_dir, "--drain-timeout", "0.1", "--max-seq-len", "512")
    try:
        with srv.client() as c:
            c.send(
                {"op": "generate", "id": "a", "input_ids": [1], "params": {"max_new_tokens": 500, "ignore_eos": True}}
            )
            assert c.stats()["in_flight"] == 1
            srv.proc.send_signal(signal.SIGTERM)
            assert c.wait("a")["finish_reason"] == "cancelled"
        srv.proc.wait(60)  # it exits by itself; a signal from stop() could only race that exit
    finally:
        code, _ = srv.stop()
    assert code == 0


def test_cli_generate_and_run_through_the_daemon(server, llama_dir, tmp_path):
    cli = [sys.executable, "-m", "flover.apps.cli"]
    gen = subprocess.run(
        [
            *cli,
            "generate",
            "--connect",
            server.addr,
            "--max-new-tokens",
            "5",
            "--ignore-eos",
            "--json",
            "Hello the cat",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["usage"]["completion_tokens"] == 5
    stream = subprocess.run(
        [*cli, "generate", "--connect", server.addr, "--max-new-tokens", "5", "--stream", "Hello the cat"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stream.returncode == 0 and "[length, 5 tokens" in stream.stderr

    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n" for i, p in enumerate(ID_PROMPTS)) + "{broken\n"
    )
    run = subprocess.run(
        [
            *cli,
            "run",
            "--connect",
            server.addr,
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            "7",
            "--ignore-eos",
            "--token-ids",
            "--ordered",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    expected = expected_outputs(llama_dir, [7] * len(ID_PROMPTS))
    assert [r["id"] for r in records] == [f"p{i}" for i in range(len(ID_PROMPTS))] + ["13"]
    assert [r["token_ids"] for r in records[:-1]] == [e.token_ids for e in expected]
    assert records[-1]["error"]["code"] == "malformed_line"


def test_curve_encryption_and_client_allow_list(llama_dir, tmp_path):
    cli = [sys.executable, "-m", "flover.apps.cli"]
    for name, where in (("server", "server"), ("client", "clients"), ("stranger", "other")):
        subprocess.run([*cli, "keygen", str(tmp_path / where), "--name", name], check=True, capture_output=True)
    http_port = free_port()
    srv = Server(
        llama_dir,
        "--curve-secret-key",
        str(tmp_path / "server" / "server.key_secret"),
        "--curve-allowed-clients",
        str(tmp_path / "clients"),
        "--http",
        f"127.0.0.1:{http_port}",
    )
    try:
        import httpx

        # the HTTP front reaches the CURVE socket with a key pair of its own, allowed by the daemon
        answer = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, timeout=30
        )
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3, answer.text
        from zmq.auth import load_certificate

        server_key, _ = load_certificate(str(tmp_path / "server" / "server.key"))
        with Client(
            srv.addr,
            timeout=10,
            curve_server_key=server_key,
            curve_client_cert=str(tmp_path / "clients" / "client.key_secret"),
        ) as c:
            assert c.health()["status"] == "ok"
        with Client(
            srv.addr,
            timeout=2,
            curve_server_key=server_key,
            curve_client_cert=str(tmp_path / "other" / "stranger.key_secret"),
        ) as c:
            with pytest.raises(FloverError, match="handshake_failed"):
                c.health(timeout=5)  # not on the allow list: the handshake is refused, and the client says so
        with Client(
            srv.addr,
            timeout=2,
            curve_server_key=server_key,
            curve_client_cert=str(tmp_path / "other" / "stranger.key_secret"),
        ) as c:
            assert c.monitor.poll(10_000)  # the refusal is reported before anything is sent
            with pytest.raises(FloverError, match="handshake_failed"):
                c.health(timeout=5)
            # the refused connection's queue is gone: a plain zmq send would now wait forever
            cancels = threading.Thread(target=lambda: [c.cancel(str(i)) for i in range(3)], daemon=True)
            cancels.start()
            cancels.join(10)
            assert not cancels.is_alive(), "cancel() blocked on a refused connection"

        async def refused_async() -> None:
            async with AsyncClient(
                srv.addr, curve_server_key=server_key, curve_client_cert=str(tmp_path / "other" / "stranger.key_secret")
            ) as c:
                with pytest.raises(FloverError, match="handshake_failed"):
                    await c.health(timeout=5)
                for i in range(3):  # each returns at once (the connection is known lost), none blocks
                    await asyncio.wait_for(c.cancel(str(i)), 5)
                with pytest.raises(FloverError, match="handshake_failed"):
                    await c.health(timeout=5)

        asyncio.run(refused_async())
        with Client(srv.addr, timeout=2) as c:  # plain text to a CURVE server: refused
            with pytest.raises(FloverError, match="handshake_failed"):
                c.health(timeout=5)
    finally:
        code, _ = srv.stop()
    assert code == 0


@pytest.mark.skipif(not __import__("tests.test_tensor_parallel", fromlist=["MPIRUN"]).MPIRUN, reason="no mpirun")
def test_daemon_under_mpirun_two_ranks(llama_dir):
    expected = expected_outputs(llama_dir, [8] * len(ID_PROMPTS))
    srv = Server(llama_dir, "--max-slots", "4", ranks=2)
    try:
        with srv.client() as c:
            send_id_prompts(c, 8)
            got = [c.wait(str(i))["token_ids"] for i in range(len(ID_PROMPTS))]
            assert got == [e.token_ids for e in expected]
            assert c.health()["status"] == "ok"
    finally:
        # SIGTERM to mpirun kills every rank at once; SIGUSR1 is forwarded and makes the leader drain
        code, err = srv.stop(signal.SIGUSR1)
    assert code == 0, err[-2000:]
    assert "SIGUSR1: draining" in err and "stopped:" in err


def test_a_failing_iteration_fails_its_requests_and_the_daemon_goes_on(llama_dir):
    """In-process daemon (no signal handlers, so it can run in a thread); the engine's next
    iteration raises once."""
    from flover import Engine, EngineConfig
    from flover.server.daemon import Daemon, ServeConfig

    engine = Engine(EngineConfig(llama_dir, max_seq_len=64, max_slots=4))
    daemon = Daemon(engine, ServeConfig(bind=f"tcp://127.0.0.1:{free_port()}", handle_signals=False))
    real_step, failures = engine.step, []

    def failing_step():
        if not failures:
            failures.append(1)
            raise RuntimeError("injected failure")
        return real_step()

    engine.step = failing_step
    thread = threading.Thread(target=daemon.serve_forever, daemon=True)
    thread.start()
    try:
        with Client(daemon.config.bind, timeout=30) as c:
            with pytest.raises(FloverError, match="internal_error.*injected failure"):
                c.generate(input_ids=[1, 2, 3], max_new_tokens=5)
            out = c.generate(input_ids=[1, 2, 3], max_new_tokens=5, ignore_eos=True)
            assert out["usage"]["completion_tokens"] == 5 and c.stats()["slots_used"] == 0
    finally:
        daemon.draining = True
        thread.join(timeout=30)
    assert not thread.is_alive()
