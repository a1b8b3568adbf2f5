"""Data-parallel engine groups (flover/engine/groups.py, flover/parallel/groups.py): the layout
and the router's choices, then real `mpirun` jobs: every request's greedy tokens equal a single
engine's, requests spread over the groups, turns of a conversation find their prefix cached, a
killed rank ends the job without leaving a client hanging, and prompt files spread over groups."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flover.client import FloverError
from flover.engine.groups import Router, prefix_keys
from flover.engine.prefix_cache import BLOCK_TOKENS
from flover.parallel.groups import group_of_ranks
from flover.server.prometheus import render
from tests.helpers import (
    ID_PROMPTS,
    MPI_ENV,
    Server,
    expected_outputs,
    flover_run_cmd,
    flover_run_ok,
    free_port,
    tokens_by_id,
    write_jsonl,
)
from tests.test_tensor_parallel import _rank_pids


def test_groups_stay_inside_nodes_when_the_nodes_allow_and_rank_0_leads_group_0():
    assert group_of_ranks(["a", "a", "b", "b"], 2) == [0, 0, 1, 1]
    assert group_of_ranks(["a", "b", "a", "b"], 2) == [0, 1, 0, 1]  # round-robin placement: groups per node
    assert group_of_ranks(["a", "a", "a", "b", "b", "b"], 2) == [0, 0, 1, 1, 2, 2]  # 3 + 3: consecutive ranks
    assert group_of_ranks(["a"] * 4, 1) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="multiple of 2"):
        group_of_ranks(["a"] * 3, 2)


def test_router_sends_a_known_prefix_to_its_group_else_the_least_loaded_one():
    router = Router(groups=2, slots=2)
    conversation = list(range(2 * BLOCK_TOKENS))
    first = router.choose(conversation, None)
    router.started(first, 100)
    other = router.choose(list(range(100, 100 + 2 * BLOCK_TOKENS)), None)
    assert other != first  # least loaded
    router.started(other, 10)
    assert router.choose(conversation + [7, 8, 9], None) == first  # the prefix, though more loaded
    assert router.choose(conversation, "another user") == other  # a cache partition of its own: no affinity
    router.started(first, 1)  # the prefix's group is full (2 slots), the other has room
    assert router.choose(conversation, None) == other
    assert router.choose([1, 2, 3], None) == other  # shorter than a block: least loaded
    router.progressed(first, 50, finished_with=51)
    assert router.load[first] == 0 and router.load[other] == 10 and router.in_flight[first] == 1
    assert len(prefix_keys(list(range(10 * BLOCK_TOKENS)), None)) == 4


def test_prefix_affinity_yields_to_load_when_every_group_is_full():
    """16 requests sharing a prefix on 2 groups of 2 slots: the backlog splits evenly (the
    affinity rule alone sent 13 of them to one group)."""
    router = Router(groups=2, slots=2)
    shared = list(range(2 * BLOCK_TOKENS))
    for i in range(16):
        router.started(router.choose(shared + [1000 + i], None), 50)
    assert sorted(router.in_flight) == [8, 8]
    router.progressed(0, 0, finished_with=50)  # group 0 frees a slot... but still has a backlog
    assert router.choose(shared, None) == 0  # fewer in flight there now: the prefix's group wins again


def _submit(client, prompt: list[int], **params) -> str:
    """Send a generate request without waiting for it; its id."""
    rid = client.new_id()
    client.send({"op": "generate", "id": rid, "stream": False, "input_ids": prompt, "params": params})
    return rid


def _serve(llama_dir, ranks: int, tp: int, *extra: str) -> Server:
    return Server(llama_dir, "--max-slots", "8", "--tp", str(tp), "--threads", "1", *extra, ranks=ranks)


@contextlib.contextmanager
def _serving(llama_dir, ranks: int, tp: int, *extra: str):
    """A data-parallel `flover serve`, stopped at the end by SIGUSR1 (mpirun forwards it: rank 0
    drains, then stops every group; SIGTERM kills them all) and asserted to exit cleanly; its
    stderr is then `srv.log`."""
    srv = _serve(llama_dir, ranks, tp, *extra)
    try:
        yield srv
    finally:
        code, srv.log = srv.stop(signal.SIGUSR1)
    assert code == 0, srv.log[-3000:]


@pytest.mark.parametrize("ranks, tp", [(2, 1), (4, 2)])
def test_every_group_serves_and_every_request_gets_a_single_engines_tokens(llama_dir, ranks, tp):
    n_tokens = [4 + (i * 5) % 17 for i in range(len(ID_PROMPTS))]
    expected = expected_outputs(llama_dir, n_tokens)
    with _serving(llama_dir, ranks, tp) as srv:
        with srv.client() as client:
            ids = [
                _submit(
                    client,
                    p,
                    max_new_tokens=n,
                    ignore_eos=True,
                    **({"logprobs": True, "top_logprobs": 2} if i % 2 else {}),
                )
                for i, (p, n) in enumerate(zip(ID_PROMPTS, n_tokens))
            ]
            got = [client.wait(i) for i in ids]
            stats = client.stats()
        groups = stats["groups"]
        assert [g["token_ids"] for g in got] == [o.token_ids for o in expected]
        with_logprobs = expected_outputs(llama_dir, n_tokens, logprobs=True, top_logprobs=2)
        for i in range(1, len(got), 2):  # every token's logprob and top 2 came back, wherever it ran
            assert got[i]["logprobs"] == pytest.approx(with_logprobs[i].logprobs, abs=1e-9)
            assert [[t for t, _ in top] for top in got[i]["top_logprobs"]] == [
                [t for t, _ in top] for top in with_logprobs[i].top_logprobs
            ]
        assert [g.get("logprobs") for g in got[::2]] == [None] * len(got[::2])
        assert [g["group"] for g in groups] == [0, 1] and all(g["routed"] >= 3 for g in groups), groups
        assert sum(g["iterations"] > 0 for g in groups) == 2, groups
        assert stats["iterations"] == sum(g["iterations"] for g in groups)
        timed = stats["metrics"]["histograms"]["iteration_time_seconds"]["counts"]
        assert sum(timed) == stats["iterations"]  # the iteration histogram holds every group's
        assert [(g["running"], g["waiting"]) for g in groups] == [(0, 0), (0, 0)], groups  # idle now, each says so
        metrics = render(stats, "m").decode()  # /metrics: a `group` label
        routed = {
            s.labels["group"]: s.value
            for f in text_string_to_metric_families(metrics)
            for s in f.samples
            if s.name == "flover:group_requests_routed_total"
        }
        assert routed == {str(g["group"]): g["routed"] for g in groups}
    assert "group=1" in srv.log and "group=0" in srv.log  # the log line per request names its group


def test_the_http_front_serves_every_group_streamed_and_not(llama_dir):
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _serving(llama_dir, 2, 1, "--http", f"127.0.0.1:{port}"):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        model = client.models.list().data[0].id
        prompts = [f"Hello the cat number {i}" for i in range(8)]

        def both(prompt: str) -> tuple[str, str]:
            whole = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
            chunks = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True)
            return whole.choices[0].text, "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(both, prompts))
        assert all(whole == streamed for whole, streamed in answers), answers
        metrics = httpx.get(f"{url}/metrics").text
        routed = {
            s.labels["group"]: s.value
            for f in text_string_to_metric_families(metrics)
            for s in f.samples
            if s.name == "flover:group_requests_routed_total"
        }
        assert set(routed) == {"0", "1"} and min(routed.values()) >= 2 and sum(routed.values()) == 16, routed


def test_streams_on_both_groups_arrive_token_by_token_and_cancel(llama_dir):
    with _serving(llama_dir, 2, 1) as srv:
        with srv.client() as client:
            streams = [
                client.stream(input_ids=[1 + i, 2, 3], request_id=f"s{i}", max_new_tokens=200, ignore_eos=True)
                for i in range(2)
            ]
            # the second is sent while the first runs: it goes to group 1
            firsts = [[next(s) for _ in range(3)] for s in streams]
            assert all(e["event"] == "token" for events in firsts for e in events)
            for i in range(2):
                client.cancel(f"s{i}")
            finals = [list(s)[-1] for s in streams]
            assert all(f["finish_reason"] == "cancelled" and f["usage"]["completion_tokens"] < 150 for f in finals)
            groups = client.stats()["groups"]
        assert [g["routed"] for g in groups] == [1, 1] and all(g["in_flight"] == 0 for g in groups), groups


def test_with_curve_a_client_owns_its_requests_on_every_group_and_its_prefix_partition(llama_dir, tmp_path):
    import sys

    from zmq.auth import load_certificate

    from flover.client import Client

    for name, where in (("server", "server"), ("alice", "clients"), ("mallory", "clients")):
        subprocess.run(
            [sys.executable, "-m", "flover.apps.cli", "keygen", str(tmp_path / where), "--name", name],
            check=True,
            capture_output=True,
        )
    server_key, _ = load_certificate(str(tmp_path / "server" / "server.key"))
    with _serving(
        llama_dir,
        2,
        1,
        "--curve-secret-key",
        str(tmp_path / "server" / "server.key_secret"),
        "--curve-allowed-clients",
        str(tmp_path / "clients"),
    ) as srv:

        def client(name: str) -> Client:
            return Client(
                srv.addr,
                timeout=60,
                curve_server_key=server_key,
                curve_client_cert=str(tmp_path / "clients" / f"{name}.key_secret"),
            )

        with client("alice") as alice, client("mallory") as mallory:
            ids = [_submit(alice, [1 + i, 2, 3], max_new_tokens=150, ignore_eos=True) for i in range(2)]
            for rid in ids:  # one on each group: neither is mallory's to cancel
                mallory.cancel(rid)
                with pytest.raises(FloverError, match="unknown_id"):
                    mallory.wait(rid)
            assert all(alice.wait(rid)["usage"]["completion_tokens"] == 150 for rid in ids)
            assert [g["routed"] for g in alice.stats()["groups"]] == [1, 1]
            prompt = [(13 * i) % 500 + 1 for i in range(40)]  # each key a prefix-cache partition, on any group
            cached = [
                c.generate(input_ids=prompt, max_new_tokens=2)["usage"]["cached_tokens"]
                for c in (alice, alice, mallory, mallory)
            ]
        assert cached == [0, 32, 0, 32], cached


def test_turns_of_a_conversation_land_where_their_prefix_is_cached(llama_dir):
    with _serving(llama_dir, 2, 1) as srv:
        with srv.client() as client:
            firsts = [[100 + 7 * c + t for t in range(2 * BLOCK_TOKENS + 3)] for c in range(4)]
            answers = [client.generate(input_ids=p, max_new_tokens=6, ignore_eos=True)["token_ids"] for p in firsts]
            seconds = [
                client.generate(input_ids=p + a + [5, 6, 7], max_new_tokens=4, ignore_eos=True)
                for p, a in zip(firsts, answers)
            ]
            routed = [g["routed"] for g in client.stats()["groups"]]
        assert all(s["usage"]["cached_tokens"] >= 2 * BLOCK_TOKENS for s in seconds), [s["usage"] for s in seconds]
        assert min(routed) >= 2, routed  # the conversations were spread, not all on one group


def test_a_killed_rank_of_another_group_ends_the_job_and_no_client_hangs(llama_dir):
    srv = _serve(llama_dir, 2, 1)
    try:
        with srv.client() as client:
            ids = [_submit(client, [1 + i, 2, 3], max_new_tokens=200, ignore_eos=True) for i in range(6)]
            deadline = time.time() + 60
            while client.stats()["groups"][1]["running"] == 0 and time.time() < deadline:
                time.sleep(0.05)
            os.kill(_rank_pids(1)[0], signal.SIGKILL)
            killed = time.time()
            with pytest.raises((FloverError, TimeoutError)) as failed:
                for i in ids:
                    client.wait(i)
            assert time.time() - killed < 20
            assert "connection" in str(failed.value).lower(), failed.value  # told, not left waiting
        srv.proc.wait(timeout=30)  # the job ended
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_a_client_that_never_reads_is_cancelled_on_every_group_and_told_so(llama_dir, tmp_path):
    from tests.test_hardening import _stream_without_reading

    srv = Server(
        llama_dir,
        "--max-slots",
        "8",
        "--tp",
        "1",
        "--threads",
        "1",
        "--max-seq-len",
        "512",
        "--max-client-backlog",
        "100000",
        ranks=2,
        addr=f"ipc://{tmp_path}/s",
    )
    try:
        results = _stream_without_reading(srv, 24, 6)
        assert {end["code"] for _, end in results.values()} == {"slow_client"}
        assert all(f"after {len(tokens)} tokens" in end["message"] for tokens, end in results.values())
        with srv.client() as client:
            stats = client.stats()
        assert stats["slow_clients"] == 1 and stats["in_flight"] == 0, stats
        assert all(g["routed"] > 0 and g["in_flight"] == 0 and g["running"] == 0 for g in stats["groups"]), stats[
            "groups"
        ]  # both groups served it and both cancelled its requests ...
        assert all(g["iterations"] < 480 for g in stats["groups"]), stats["groups"]  # ... long before their end
    finally:
        assert srv.stop(signal.SIGUSR1)[0] == 0


@pytest.mark.parametrize(
    "drain_timeout, reason, per_group, tokens", [("30", "length", 1, 300), ("0.1", "cancelled", 8, 500)]
)
def test_a_drain_finishes_or_cancels_the_requests_of_every_group_then_exits_0(
    llama_dir, drain_timeout, reason, per_group, tokens
):
    srv = _serve(llama_dir, 2, 1, "--drain-timeout", drain_timeout, "--max-seq-len", "512")
    try:
        with srv.client() as client:
            ids = [_submit(client, [1 + i, 2], max_new_tokens=tokens, ignore_eos=True) for i in range(2 * per_group)]
            groups = client.stats()["groups"]
            assert [g["in_flight"] for g in groups] == [per_group, per_group], groups  # as many on each group
            srv.proc.send_signal(signal.SIGUSR1)  # (mpirun forwards it; SIGTERM would kill every rank)
            deadline = time.time() + 10
            while client.health()["status"] != "draining" and time.time() < deadline:
                time.sleep(0.01)
            with pytest.raises(FloverError, match="shutting_down"):
                client.generate(input_ids=[3], max_new_tokens=2)
            finals = [client.wait(i) for i in ids]
        assert {f["finish_reason"] for f in finals} == {reason}, [(f["finish_reason"], f["usage"]) for f in finals]
        if reason == "length":
            assert [f["usage"]["completion_tokens"] for f in finals] == [tokens] * len(ids)
        srv.proc.wait(60)  # it exits by itself once the groups are done
    finally:
        code, log = srv.stop(signal.SIGUSR1)
    assert code == 0 and "draining" in log, log[-3000:]


def test_a_prompt_file_spreads_over_groups_into_one_output_and_resumes_exactly_once(llama_dir, tmp_path):
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(
        prompts, [{"id": f"p{i}", "input_ids": p, "max_new_tokens": 3 + i % 5} for i, p in enumerate(ID_PROMPTS)]
    )
    expected = {
        f"p{i}": o.token_ids
        for i, o in enumerate(expected_outputs(llama_dir, [3 + i % 5 for i in range(len(ID_PROMPTS))]))
    }
    run = flover_run_ok(2, llama_dir, prompts, out, "--tp", "1", "--max-slots", "4", "--threads", "1")
    assert tokens_by_id(out) == expected
    assert "2 groups" in run.stderr or "data parallel: 2 groups" in run.stderr, run.stderr[-2000:]
    again = subprocess.run(
        flover_run_cmd(2, llama_dir, prompts, out, "--tp", "1", "--threads", "1"),
        capture_output=True,
        text=True,
        timeout=240,
        env=MPI_ENV,
    )
    assert again.returncode == 0 and f"{len(ID_PROMPTS)} already done" in again.stderr, again.stderr[-2000:]
    assert len(out.read_text().splitlines()) == len(ID_PROMPTS)


def test_tp_that_does_not_divide_the_ranks_is_refused(llama_dir, tmp_path):
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(prompts, [{"id": "a", "input_ids": [1, 2]}])
    run = subprocess.run(
        flover_run_cmd(3, llama_dir, prompts, out, "--tp", "2"),
        capture_output=True,
        text=True,
        timeout=120,
        env=MPI_ENV,
    )
    assert run.returncode != 0 and "groups of --tp ranks" in run.stderr, run.stderr[-2000:]
    assert not out.exists() or not out.read_text().strip()


def test_every_rank_of_a_job_takes_its_own_gpu_whatever_its_groups_size(monkeypatch):
    """`mpirun -np 8 flover serve --device cuda --tp 1`: 8 groups of one rank, one GPU each (not all on cuda:0)."""
    from flover.apps.cli import build_parser
    from flover.apps.flags import engine_config

    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    for tp in ("1", "2", "8"):
        args = build_parser().parse_args(["serve", "--model", "m", "--device", "cuda", "--tp", tp])
        assert engine_config(args).device == "cuda:3"


def test_a_streamed_http_answer_whose_group_dies_ends_with_an_error_event(llama_dir):
    """SIGKILL of a group leader mid-stream: the HTTP client gets an error event (never a 200 that
    just stops, which reads like a finished answer)."""
    import httpx

    from tests.helpers import free_port

    port = free_port()
    srv = _serve(llama_dir, 2, 1, "--http", f"127.0.0.1:{port}", "--max-seq-len", "512")
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        with httpx.Client(timeout=60) as http:
            with contextlib.ExitStack() as streams:
                lines = []
                for i in range(4):  # some land on group 1
                    r = streams.enter_context(
                        http.stream(
                            "POST",
                            url,
                            json={
                                "prompt": [1 + i, 2, 3],
                                "max_tokens": 500,
                                "ignore_eos": True,
                                "stream": True,
                                "temperature": 0,
                            },
                        )
                    )
                    assert r.status_code == 200
                    lines.append(r.iter_lines())
                    next(line for line in lines[-1] if line.startswith("data:"))  # its first token
                os.kill(_rank_pids(1)[0], signal.SIGSTOP)  # group 1's streams cannot finish now
                os.kill(_rank_pids(1)[0], signal.SIGKILL)
                errors = 0
                for stream in lines:  # each ends with its finish and [DONE], or with an error
                    data = [
                        json.loads(line[5:]) for line in stream if line.startswith("data:") and "[DONE]" not in line
                    ]
                    finished = data[-1].get("choices") and data[-1]["choices"][0]["finish_reason"] is not None
                    assert finished or "error" in data[-1], data[-2:]
                    errors += "error" in data[-1]
                assert errors >= 1
        srv.proc.wait(timeout=30)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_structured_requests_on_every_group_compile_beside_its_loop_and_match(llama_dir):
    """Distinct structures spread over 2 groups: a group's leader compiles each on a thread
    (GrammarWork) while its requests wait, then runs it; every answer matches its structure, a
    request cancelled while its grammar compiles is cancelled, and one that does not compile is
    refused on rank 0 before any group sees it."""
    import re

    from flover.client import FloverError

    with _serving(llama_dir, 2, 1) as srv:
        with srv.client() as client:
            patterns = [f"[a-z]{{{2 + i}}}-{i}[0-9]{{2}}" for i in range(8)]
            ids = [
                _submit(client, [1 + i, 2, 3], max_new_tokens=40, structured={"kind": "regex", "value": p})
                for i, p in enumerate(patterns)
            ]
            cancelled = _submit(
                client,
                [9, 9],
                max_new_tokens=200,
                structured={"kind": "regex", "value": "[a-z]{3}-cancelled-[a-z]{60}"},
            )
            client.cancel(cancelled)
            got = [client.wait(i) for i in ids]
            assert client.wait(cancelled)["finish_reason"] == "cancelled"
            with pytest.raises(FloverError, match="does not compile"):
                client.generate(input_ids=[1, 2], max_new_tokens=4, structured={"kind": "regex", "value": "[a-"})
            routed = [g["routed"] for g in client.stats()["groups"]]
        assert all(re.fullmatch(p, g["text"]) and g["finish_reason"] == "stop" for p, g in zip(patterns, got)), got
        assert min(routed) >= 2, routed
